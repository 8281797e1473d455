//! Server-sent events read incrementally from a response body that arrives
//! in arbitrary pieces: `data:` payloads in order (multi-line data joined,
//! LF or CRLF separators); comments (`: keepalive`) and other fields
//! skipped; `data: [DONE]` (OpenAI's end of stream) as its own event.

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SseEvent {
    Data(String),
    /// `data: [DONE]`: the upstream finished the stream.
    Done,
}

#[derive(Debug, Default)]
pub struct SseDecoder {
    buffer: Vec<u8>,
}

impl SseDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes; returns every event they complete.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        self.buffer.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some((end, sep)) = event_end(&self.buffer) {
            let event: Vec<u8> = self.buffer.drain(..end + sep).collect();
            if let Some(e) = parse_event(&event[..end]) {
                out.push(e);
            }
        }
        out
    }
}

/// Where the first complete event ends and how long its separator is.
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

fn parse_event(raw: &[u8]) -> Option<SseEvent> {
    let text = String::from_utf8_lossy(raw);
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.strip_prefix(' ').unwrap_or(d))
        .collect();
    if data.is_empty() {
        return None;
    }
    let data = data.join("\n");
    if data.trim() == "[DONE]" {
        Some(SseEvent::Done)
    } else {
        Some(SseEvent::Data(data))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_reads() {
        let mut d = SseDecoder::new();
        assert!(d.push(b": keepalive 1/4\n\ndata: {\"a\"").is_empty());
        assert_eq!(
            d.push(b":1}\n\ndata: {\"b\":2}\r\n\r\ndata: [DONE]\n\n"),
            vec![
                SseEvent::Data("{\"a\":1}".into()),
                SseEvent::Data("{\"b\":2}".into()),
                SseEvent::Done
            ]
        );
        assert!(d.push(b"").is_empty());
    }

    #[test]
    fn multi_line_data_and_no_space() {
        let mut d = SseDecoder::new();
        assert_eq!(
            d.push(b"event: x\ndata:1\ndata: 2\n\n"),
            vec![SseEvent::Data("1\n2".into())]
        );
    }
}
