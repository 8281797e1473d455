//! A small blocking HTTP/1.1 client: enough to send requests, read whole
//! responses (chunked or not) and read server-sent events incrementally,
//! with full control over when the connection is dropped.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::Duration;

use serde_json::Value;

#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }

    /// The `data:` payloads of an SSE body, in order.
    pub fn sse_data(&self) -> Vec<String> {
        parse_events(&self.text())
    }
}

/// The JSON chunks among SSE data events, without the closing `[DONE]`.
pub fn json_chunks(events: &[String]) -> Vec<Value> {
    let events = match events.split_last() {
        Some((last, rest)) if last == "[DONE]" => rest,
        _ => events,
    };
    events
        .iter()
        .map(|e| serde_json::from_str(e).unwrap_or_else(|err| panic!("{e:?} is not JSON: {err}")))
        .collect()
}

fn parse_events(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            e.lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .collect::<Vec<_>>()
                .join("\n")
        })
        .collect()
}

fn connect(addr: SocketAddr) -> TcpStream {
    let stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    stream
        .set_read_timeout(Some(Duration::from_secs(300)))
        .unwrap();
    stream
}

fn write_request(
    stream: &mut TcpStream,
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if !body.is_empty() || method == "POST" {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    if !headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
        && !body.is_empty()
    {
        head.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).unwrap();
    // A server may answer (413) before reading a large body; that is fine.
    let _ = stream.write_all(body);
}

fn read_head(reader: &mut BufReader<TcpStream>) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    reader.read_line(&mut line).expect("status line");
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut headers = Vec::new();
    loop {
        line.clear();
        reader.read_line(&mut line).expect("header line");
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_owned(), v.trim().to_owned()));
        }
    }
    (status, headers)
}

fn is_chunked(headers: &[(String, String)]) -> bool {
    headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
    })
}

/// One chunk of a chunked body; `None` at the last chunk.
fn read_chunk(reader: &mut BufReader<TcpStream>) -> Option<Vec<u8>> {
    let mut size = String::new();
    if reader.read_line(&mut size).ok()? == 0 {
        return None;
    }
    let n = usize::from_str_radix(size.trim().split(';').next()?, 16).ok()?;
    let mut data = vec![0; n];
    reader.read_exact(&mut data).ok()?;
    let mut crlf = [0; 2];
    reader.read_exact(&mut crlf).ok()?;
    (n > 0).then_some(data)
}

pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Response {
    let mut stream = connect(addr);
    write_request(&mut stream, addr, method, path, headers, body);
    let mut reader = BufReader::new(stream);
    let (status, headers) = read_head(&mut reader);
    let mut body = Vec::new();
    if is_chunked(&headers) {
        while let Some(chunk) = read_chunk(&mut reader) {
            body.extend(chunk);
        }
    } else {
        let _ = reader.read_to_end(&mut body);
    }
    Response {
        status,
        headers,
        body,
    }
}

pub fn get(addr: SocketAddr, path: &str) -> Response {
    request(addr, "GET", path, &[], b"")
}

pub fn post_json(addr: SocketAddr, path: &str, body: &Value) -> Response {
    request(addr, "POST", path, &[], body.to_string().as_bytes())
}

/// A streamed response read event by event; dropping it closes the
/// connection (a client disconnect).
pub struct SseStream {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    reader: BufReader<TcpStream>,
    buffer: String,
}

impl SseStream {
    pub fn open(addr: SocketAddr, path: &str, body: &Value) -> SseStream {
        let mut stream = connect(addr);
        write_request(
            &mut stream,
            addr,
            "POST",
            path,
            &[],
            body.to_string().as_bytes(),
        );
        let mut reader = BufReader::new(stream);
        let (status, headers) = read_head(&mut reader);
        SseStream {
            status,
            headers,
            reader,
            buffer: String::new(),
        }
    }

    /// The next event's data, `None` at the end of the body.
    pub fn next_event(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let event: String = self.buffer.drain(..end + 2).collect();
                return parse_events(&event).into_iter().next();
            }
            let chunk = read_chunk(&mut self.reader)?;
            self.buffer.push_str(&String::from_utf8_lossy(&chunk));
        }
    }

    /// The whole body of a response that did not start a stream (an
    /// error answer).
    pub fn body(mut self) -> Vec<u8> {
        let mut body = std::mem::take(&mut self.buffer).into_bytes();
        if is_chunked(&self.headers) {
            while let Some(chunk) = read_chunk(&mut self.reader) {
                body.extend(chunk);
            }
        } else {
            let _ = self.reader.read_to_end(&mut body);
        }
        body
    }

    /// Closes the connection at once.
    pub fn disconnect(self) {
        let _ = self.reader.get_ref().shutdown(Shutdown::Both);
    }
}
