//! What a benchmark side measured, and the numbers printed from it.

/// One side of one scenario (or one path of the write-path comparison).
#[derive(Debug, Default, Clone)]
pub struct Report {
    pub cycles: u64,
    pub owner_changes: u64,
    pub errors: u64,
    pub lost_updates: i64,
    pub secs: f64,
    /// Time to acquire (lock scenarios), sorted.
    pub wait_us: Vec<u32>,
    /// Time of a whole cycle or request, sorted.
    pub cycle_us: Vec<u32>,
    pub per_client: Vec<u64>,
    /// CPU per cycle in µs of (bench client, sidecar, Redis), when the
    /// benchmark started those processes itself (`--local`).
    pub cpu_us: Option<[f64; 3]>,
}

impl Report {
    pub fn rate(&self, n: u64) -> f64 {
        n as f64 / self.secs.max(1e-9)
    }

    pub fn cycles_per_sec(&self) -> f64 {
        self.rate(self.cycles)
    }

    /// The `p` quantile (0..=1) of sorted microseconds, in milliseconds.
    pub fn pct(v: &[u32], p: f64) -> f64 {
        if v.is_empty() {
            return 0.0;
        }
        v[((v.len() - 1) as f64 * p) as usize] as f64 / 1000.0
    }

    pub fn fairness(&self) -> f64 {
        let min = self.per_client.iter().min().copied().unwrap_or(0) as f64;
        let max = self.per_client.iter().max().copied().unwrap_or(0) as f64;
        if max == 0.0 {
            0.0
        } else {
            min / max
        }
    }

    /// Adds one client's counts.
    pub fn absorb(&mut self, r: Report) {
        self.cycles += r.cycles;
        self.owner_changes += r.owner_changes;
        self.errors += r.errors;
        self.wait_us.extend(r.wait_us);
        self.cycle_us.extend(r.cycle_us);
        self.per_client.push(r.cycles);
    }

    pub fn sort(&mut self) {
        self.wait_us.sort_unstable();
        self.cycle_us.sort_unstable();
    }

    /// Records one cycle that took `cycle` after waiting `wait`.
    pub fn record(&mut self, wait: std::time::Duration, cycle: std::time::Duration) {
        self.cycles += 1;
        self.wait_us.push(micros(wait));
        self.cycle_us.push(micros(cycle));
    }
}

/// Waits for every client task started at `started` and adds up their
/// reports (rates over the time until the last one finished).
pub async fn join(
    tasks: Vec<tokio::task::JoinHandle<Result<Report, String>>>,
    started: std::time::Instant,
) -> Result<Report, String> {
    let mut total = Report::default();
    for t in tasks {
        total.absorb(t.await.map_err(|e| e.to_string())??);
    }
    total.secs = started.elapsed().as_secs_f64();
    total.sort();
    Ok(total)
}

fn micros(d: std::time::Duration) -> u32 {
    d.as_micros().min(u32::MAX as u128) as u32
}

/// The median of `v` (upper median for even lengths); 0 when empty.
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The report whose cycle rate is the median of `runs`.
pub fn median_run(runs: &[Report]) -> Option<&Report> {
    let mut idx: Vec<usize> = (0..runs.len()).collect();
    idx.sort_by(|a, b| {
        runs[*a]
            .cycles_per_sec()
            .total_cmp(&runs[*b].cycles_per_sec())
    });
    idx.get(runs.len() / 2).map(|i| &runs[*i])
}

/// The CPU line of a lock-scenario side, if measured.
pub fn cpu_line(r: &Report) -> Option<String> {
    let [client, sidecar, redis] = r.cpu_us?;
    Some(format!(
        "            cpu µs per cycle: client {client:.1}  sidecar {sidecar:.1}  redis {redis:.1}  total {:.1}",
        client + sidecar + redis
    ))
}

/// One printed line for a lock-scenario side.
pub fn lock_line(label: &str, r: &Report) -> String {
    format!(
        "  {label:<9} cycles/s {:>9.0}  owner changes/s {:>8.0}  wait p50/p99/max ms {:>6.2}/{:>6.2}/{:>7.2}  cycle p50/p99 ms {:>6.2}/{:>6.2}  fairness {:.2}  lost {}  errors {}",
        r.cycles_per_sec(),
        r.rate(r.owner_changes),
        Report::pct(&r.wait_us, 0.5),
        Report::pct(&r.wait_us, 0.99),
        Report::pct(&r.wait_us, 1.0),
        Report::pct(&r.cycle_us, 0.5),
        Report::pct(&r.cycle_us, 0.99),
        r.fairness(),
        r.lost_updates,
        r.errors,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_percentiles() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![]), 0.0);
        let v: Vec<u32> = (1..=100).map(|i| i * 1000).collect();
        assert_eq!(Report::pct(&v, 0.5), 50.0);
        assert_eq!(Report::pct(&v, 1.0), 100.0);
        let runs: Vec<Report> = [5u64, 1, 9]
            .iter()
            .map(|c| Report {
                cycles: *c,
                secs: 1.0,
                ..Report::default()
            })
            .collect();
        assert_eq!(median_run(&runs).unwrap().cycles, 5);
    }
}
