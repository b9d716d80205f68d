//! Kubernetes resource quantities, as far as the injector needs them: to
//! refuse a `fencer.dev/memory-limit: "256MB "` before the API server does
//! (it would reject the whole pod, not just the sidecar), and to check that
//! a request does not exceed its limit.

/// The value of `q` in base units (cores or bytes). CPU takes `m` or no
/// suffix; memory takes the binary (`Ki`…`Ti`) or decimal (`k`…`T`) ones.
pub fn parse(q: &str, memory: bool) -> Result<f64, String> {
    let split = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(q.len());
    let (number, suffix) = q.split_at(split);
    let valid_number = !number.is_empty()
        && number.len() <= 18
        && number.matches('.').count() <= 1
        && !number.starts_with('.')
        && !number.ends_with('.');
    if !valid_number {
        return Err(format!("`{q}` is not a quantity (e.g. 50m, 1, 256Mi)"));
    }
    let value: f64 = number
        .parse()
        .map_err(|_| format!("`{q}` is not a quantity"))?;
    let factor = match (memory, suffix) {
        (_, "") => 1.0,
        (false, "m") => 1e-3,
        (true, "k") => 1e3,
        (true, "M") => 1e6,
        (true, "G") => 1e9,
        (true, "T") => 1e12,
        (true, "Ki") => 1024.0,
        (true, "Mi") => 1024.0 * 1024.0,
        (true, "Gi") => 1024.0 * 1024.0 * 1024.0,
        (true, "Ti") => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => {
            let allowed = if memory {
                "Ki, Mi, Gi, Ti, k, M, G, T or none"
            } else {
                "m or none"
            };
            return Err(format!(
                "`{q}`: unit `{suffix}` not allowed here ({allowed})"
            ));
        }
    };
    let v = value * factor;
    if v <= 0.0 {
        return Err(format!("`{q}` must be above zero"));
    }
    Ok(v)
}

pub fn check_request_within_limit(request: &str, limit: &str, memory: bool) -> Result<(), String> {
    if parse(request, memory)? > parse(limit, memory)? {
        return Err(format!("request {request} is above the limit {limit}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_parse_and_bad_ones_are_refused() {
        assert_eq!(parse("50m", false).unwrap(), 0.05);
        assert_eq!(parse("2", false).unwrap(), 2.0);
        assert_eq!(parse("0.5", false).unwrap(), 0.5);
        assert_eq!(parse("256Mi", true).unwrap(), 256.0 * 1048576.0);
        assert_eq!(parse("1G", true).unwrap(), 1e9);
        for bad in [
            "", "m", "1.", ".5", "1..2", "256MB", "256Mi ", "-1", "0", "1e3", "50m",
        ] {
            assert!(parse(bad, true).is_err(), "{bad} accepted as memory");
        }
        for bad in ["1Gi", "5 m", "0m"] {
            assert!(parse(bad, false).is_err(), "{bad} accepted as cpu");
        }
        assert!(check_request_within_limit("64Mi", "32Mi", true).is_err());
        assert!(check_request_within_limit("500m", "1", false).is_ok());
    }
}
