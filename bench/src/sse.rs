//! Server-sent events from a byte stream that arrives in arbitrary pieces:
//! the `data:` payload of each complete event, in order.

#[derive(Debug, Default)]
pub struct SseParser {
    pending: Vec<u8>,
}

impl SseParser {
    /// Feeds bytes; returns the events they completed.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.pending.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some((end, sep)) = event_end(&self.pending) {
            let raw: Vec<u8> = self.pending.drain(..end + sep).collect();
            if let Some(data) = data_of(&String::from_utf8_lossy(&raw[..end])) {
                events.push(data);
            }
        }
        events
    }
}

/// Where the first event ends and how long its separator (a blank line,
/// LF or CRLF) is.
fn event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = find(buf, b"\n\n").map(|i| (i, 2));
    let crlf = find(buf, b"\r\n\r\n").map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The joined `data:` lines of one event; `None` for comments and events
/// without data.
fn data_of(event: &str) -> Option<String> {
    let lines: Vec<&str> = event
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.strip_prefix(' ').unwrap_or(d))
        .collect();
    (!lines.is_empty()).then(|| lines.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_pieces_and_separators() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\"").is_empty());
        assert_eq!(p.push(b":1}\n\ndata: x\n"), vec!["{\"a\":1}"]);
        assert_eq!(
            p.push(b"\n: keep-alive\n\ndata:[DONE]\r\n\r\n"),
            vec!["x", "[DONE]"]
        );
        assert_eq!(p.push(b"event: e\ndata: a\ndata: b\n\n"), vec!["a\nb"]);
    }
}
