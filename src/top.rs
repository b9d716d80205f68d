//! `fencer top`: a live terminal view of a running sidecar or gateway, from
//! its own endpoints (`/metrics`, and the lock API's `/v1/locks`): what an
//! operator opens first during a contention incident.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

#[derive(Debug, Clone, clap::Args)]
pub struct TopArgs {
    /// The process's metrics endpoint base URL.
    #[arg(long, default_value = "http://127.0.0.1:9411")]
    pub admin: String,
    /// The sidecar's lock API (for the lease table); leave empty for a gateway.
    #[arg(long, default_value = "http://127.0.0.1:7411")]
    pub api: String,
    /// Print one snapshot (two samples one interval apart) and exit.
    #[arg(long)]
    pub once: bool,
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(100..=60_000))]
    pub interval_ms: u64,
    /// Lease rows to show.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub rows: u64,
    /// Keys to show as the backend records them, whichever sidecar holds
    /// them (`GET /v1/locks/{key}?scope=backend`; one read per key per
    /// frame, within the sidecar's `backend_view_per_second`). Repeatable,
    /// up to 10.
    #[arg(long = "key", num_args = 1, value_name = "KEY")]
    pub keys: Vec<String>,
}

/// At most this many `--key`s: each costs one backend read per frame.
pub const MAX_KEYS: usize = 10;

/// One series of a scrape: name, labels, value.
type Series = (String, Vec<(String, String)>, f64);

/// One scrape.
#[derive(Default)]
struct Sample(Vec<Series>);

impl Sample {
    fn parse(text: &str) -> Sample {
        let mut out = Vec::new();
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            let labels = labels
                .split("\",")
                .filter_map(|kv| {
                    let (k, v) = kv.split_once("=\"")?;
                    Some((
                        k.trim_matches(',').to_owned(),
                        v.trim_end_matches('"').to_owned(),
                    ))
                })
                .collect();
            out.push((name.to_owned(), labels, value));
        }
        Sample(out)
    }

    fn sum(&self, name: &str, filter: &[(&str, &str)]) -> f64 {
        self.0
            .iter()
            .filter(|(n, labels, _)| {
                n == name
                    && filter
                        .iter()
                        .all(|(k, v)| labels.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .fold(0.0, |acc, (_, _, v)| acc + v)
    }

    fn by(&self, name: &str, label: &str) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for (n, labels, v) in &self.0 {
            if n == name {
                if let Some((_, lv)) = labels.iter().find(|(k, _)| k == label) {
                    *out.entry(lv.clone()).or_default() += v;
                }
            }
        }
        out
    }

    fn label(&self, name: &str, label: &str) -> Option<String> {
        self.0
            .iter()
            .find(|(n, _, _)| n == name)
            .and_then(|(_, labels, _)| {
                labels
                    .iter()
                    .find(|(k, _)| k == label)
                    .map(|(_, v)| v.clone())
            })
    }
}

/// p99 of a histogram's increase between two samples, in seconds.
fn p99(before: &Sample, after: &Sample, name: &str) -> Option<f64> {
    let buckets = |s: &Sample| s.by(&format!("{name}_bucket"), "le");
    let (b, a) = (buckets(before), buckets(after));
    let mut points: Vec<(f64, f64)> = a
        .iter()
        .filter_map(|(le, v)| {
            let le: f64 = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, v - b.get(le_key(le).as_str()).copied().unwrap_or(0.0)))
        })
        .collect();
    points.sort_by(|x, y| x.0.total_cmp(&y.0));
    let total = points.last()?.1;
    if total <= 0.0 {
        return None;
    }
    points
        .iter()
        .find(|(_, c)| *c >= total * 0.99)
        .map(|(le, _)| *le)
}

fn le_key(le: f64) -> String {
    if le.is_infinite() {
        "+Inf".into()
    } else {
        format!("{le}")
    }
}

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

async fn get(client: &HttpClient, url: &str) -> Result<String, String> {
    let uri: hyper::Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
    let resp = tokio::time::timeout(Duration::from_secs(5), client.get(uri))
        .await
        .map_err(|_| format!("{url}: timed out"))?
        .map_err(|e| format!("{url}: {e}"))?;
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    String::from_utf8(body.to_vec()).map_err(|e| e.to_string())
}

fn fmt_ms(ms: f64) -> String {
    if ms >= 1000.0 {
        format!("{:.1}s", ms / 1000.0)
    } else {
        format!("{ms:.0}ms")
    }
}

async fn frame(
    client: &HttpClient,
    args: &TopArgs,
    before: &Sample,
    after: &Sample,
    secs: f64,
) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let role = after.label("fencer_build_info", "role").unwrap_or_default();
    let backend = after
        .label("fencer_build_info", "backend")
        .unwrap_or_default();
    let rate =
        |name: &str, f: &[(&str, &str)]| (after.sum(name, f) - before.sum(name, f)).max(0.0) / secs;
    let _ = writeln!(out, "fencer top — {} ({role}, {backend})", args.admin);
    let acq = rate("fencer_acquisitions_total", &[]);
    let ok = rate("fencer_acquisitions_total", &[("result", "acquired")]);
    let timeouts = rate("fencer_acquisitions_total", &[("result", "timeout")]);
    let wait = p99(before, after, "fencer_acquire_wait_seconds")
        .map(|s| {
            if s.is_infinite() {
                "> 300s".into()
            } else {
                fmt_ms(s * 1000.0)
            }
        })
        .unwrap_or_else(|| "-".into());
    let _ = writeln!(
        out,
        "acquisitions/s {acq:.1} (acquired {ok:.1}, timeout {timeouts:.1})   wait p99 {wait}   leases held {}",
        after.sum("fencer_leases_held", &[])
    );
    let _ = writeln!(
        out,
        "lost leases {} (total)   stale writes rejected {} (total)   backend up {}",
        after.sum("fencer_lost_leases_total", &[]),
        after.sum("fencer_gateway_requests_total", &[("result", "stale")]),
        after.sum("fencer_backend_up", &[]),
    );
    let waiters: Vec<String> = after
        .by("fencer_waiters", "group")
        .into_iter()
        .map(|(g, n)| format!("{g}={n}"))
        .collect();
    let _ = writeln!(
        out,
        "waiters by group: {}",
        if waiters.is_empty() {
            "-".into()
        } else {
            waiters.join(" ")
        }
    );
    if !args.api.is_empty() {
        let url = format!(
            "{}/v1/locks?limit={}",
            args.api.trim_end_matches('/'),
            args.rows
        );
        match get(client, &url)
            .await
            .map(|t| serde_json::from_str::<Value>(&t))
        {
            Ok(Ok(list)) => {
                let _ = writeln!(out, "\nLEASES ({} tracked)", list["total"]);
                let _ = writeln!(
                    out,
                    "{:<40} {:>20} {:>9} {:>10} {:<5} {:<6}",
                    "KEY", "TOKEN", "AGE", "REMAINING", "STATE", "RENEW"
                );
                for l in list["leases"].as_array().into_iter().flatten() {
                    let _ = writeln!(
                        out,
                        "{:<40} {:>20} {:>9} {:>10} {:<5} {:<6}",
                        l["key"].as_str().unwrap_or(""),
                        l["token"].to_string(),
                        fmt_ms(l["held_ms"].as_f64().unwrap_or(0.0)),
                        fmt_ms(l["remaining_ms"].as_f64().unwrap_or(0.0)),
                        l["state"].as_str().unwrap_or(""),
                        l["renewal"].as_str().unwrap_or(""),
                    );
                }
            }
            _ => {
                let _ = writeln!(out, "\n(lease table unavailable at {url})");
            }
        }
        if !args.keys.is_empty() {
            let _ = writeln!(out, "\nIN THE BACKEND");
            let _ = writeln!(
                out,
                "{:<40} {:<8} {:>20} {:<16} {:>10} {:>7} {:<4}",
                "KEY", "STATE", "TOKEN", "LEASE TAG", "REMAINING", "WAITING", "HERE"
            );
            for key in &args.keys {
                let url = format!(
                    "{}/v1/locks/{}?scope=backend",
                    args.api.trim_end_matches('/'),
                    percent_encoding::utf8_percent_encode(key, percent_encoding::NON_ALPHANUMERIC)
                );
                let v = match get(client, &url)
                    .await
                    .map(|t| serde_json::from_str::<Value>(&t))
                {
                    Ok(Ok(v)) => v,
                    _ => Value::Null,
                };
                let _ = writeln!(out, "{}", backend_row(key, &v));
            }
        }
    }
    out
}

/// One row of the backend view (an error answer shows its code).
fn backend_row(key: &str, v: &Value) -> String {
    let text = |f: &str| v[f].as_str().unwrap_or("-").to_owned();
    let num = |f: &str| v[f].as_u64().map_or("-".to_owned(), |n| n.to_string());
    let state = match (v["state"].as_str(), v["error"].as_str()) {
        // Read leases hold it: how many.
        (Some("read"), _) => format!("read({})", num("readers")),
        (Some(s), _) => s.to_owned(),
        (None, Some(e)) => e.to_owned(),
        _ => "unreachable".to_owned(),
    };
    let left = match (v["remaining_ms"].as_f64(), v["retry_after_ms"].as_f64()) {
        (Some(ms), _) | (None, Some(ms)) => fmt_ms(ms),
        _ => "-".into(),
    };
    let here = match v["held_here"].as_bool() {
        Some(true) => "yes",
        Some(false) => "no",
        None => "-",
    };
    format!(
        "{key:<40} {state:<8} {:>20} {:<16} {left:>10} {:>7} {here:<4}",
        num("token"),
        text("lease_tag"),
        num("waiting"),
    )
}

pub async fn run(args: TopArgs) -> Result<(), String> {
    if args.keys.len() > MAX_KEYS {
        return Err(format!(
            "at most {MAX_KEYS} --key (each is one backend read per frame)"
        ));
    }
    if !args.keys.is_empty() && args.api.is_empty() {
        return Err("--key needs the sidecar's lock API (--api)".into());
    }
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let metrics_url = format!("{}/metrics", args.admin.trim_end_matches('/'));
    let interval = Duration::from_millis(args.interval_ms);
    let mut before = Sample::parse(&get(&client, &metrics_url).await?);
    let mut at = Instant::now();
    loop {
        tokio::time::sleep(interval).await;
        let after = Sample::parse(&get(&client, &metrics_url).await?);
        let secs = at.elapsed().as_secs_f64();
        at = Instant::now();
        let text = frame(&client, &args, &before, &after, secs).await;
        if args.once {
            crate::out!("{text}");
            return Ok(());
        }
        // Clear the screen and draw the frame; a terminal or pipe that has
        // gone ends the view.
        if !crate::out!("\x1b[2J\x1b[H{text}") {
            return Ok(());
        }
        before = after;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_rows_show_state_token_tag_and_time_left() {
        let held = serde_json::json!({"state": "held", "token": 7, "lease_tag": "abc",
            "remaining_ms": 1500, "held_here": false, "waiting": 2});
        let row = backend_row("k", &held);
        for part in ["held", " 7 ", "abc", "1.5s", " 2 ", "no"] {
            assert!(row.contains(part), "{part:?} in {row:?}");
        }
        let read = serde_json::json!({"state": "read", "readers": 3, "waiting": 1});
        assert!(backend_row("k", &read).contains("read(3)"));
        let limited = serde_json::json!({"error": "rate_limited", "retry_after_ms": 90});
        assert!(backend_row("k", &limited).contains("rate_limited"));
    }

    #[test]
    fn parses_and_sums() {
        let s = Sample::parse(
            "# HELP x y\nfencer_acquisitions_total{group=\"a\",result=\"acquired\"} 3\nfencer_acquisitions_total{group=\"b\",result=\"timeout\"} 2\nfencer_leases_held{group=\"a\"} 4\n",
        );
        assert_eq!(s.sum("fencer_acquisitions_total", &[]), 5.0);
        assert_eq!(
            s.sum("fencer_acquisitions_total", &[("result", "timeout")]),
            2.0
        );
        assert_eq!(s.by("fencer_leases_held", "group")["a"], 4.0);
    }
}
