//! An error with every cause under it, in one line.
//!
//! Client libraries wrap the reason a connection failed: hyper's client
//! prints "client error (Connect)", deadpool "error connecting to server",
//! and the refusal, the timeout or the DNS failure is only in their
//! `source()` chain. An operator reading a 503 or a log line needs that
//! reason next to the address that was tried; the callers add the address.

/// `e` followed by each cause not already in the text, joined by `: `.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::chain;

    #[derive(Debug, thiserror::Error)]
    #[error("client error (Connect)")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn causes_are_appended_once() {
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let text = chain(&Outer(refused));
        assert!(
            text.starts_with("client error (Connect): ") && text.contains("refused"),
            "{text}"
        );
    }
}
