//! The Prometheus endpoint: a small HTTP/1.1 server on tokio that answers
//! `GET /metrics` and closes the connection.
//!
//! It is bounded so that it cannot take usher down: at most
//! `max_connections` connections at once (the next wait in the kernel's
//! listen backlog, holding none of usher's descriptors), a request head of
//! at most [`MAX_HEAD`] bytes that must arrive within `timeout`, the
//! response written within `timeout` again, one request per connection,
//! and an accept loop that backs off when accepting fails
//! ([`crate::accept::AcceptBackoff`]).

use crate::accept::AcceptBackoff;
use metrics_exporter_prometheus::PrometheusHandle;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// Largest request head (request line and headers) read.
pub const MAX_HEAD: usize = 8 * 1024;
/// Bytes read and dropped after the response, before closing.
const DRAIN_MAX: usize = 64 * 1024;

/// The bounds of the endpoint.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections served at once.
    pub max_connections: usize,
    /// To send the request head; again to take the response.
    pub timeout: Duration,
}

/// Serves `/metrics` from `handle` on `listener` for ever.
pub async fn serve(listener: TcpListener, handle: PrometheusHandle, limits: Limits) {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let mut backoff = AcceptBackoff::new("metrics");
    loop {
        // A permit before accepting: beyond the bound, connections wait in
        // the backlog rather than in usher.
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        match listener.accept().await {
            Ok((stream, _)) => {
                backoff.accepted();
                let handle = handle.clone();
                tokio::spawn(async move {
                    answer(stream, &handle, limits.timeout).await;
                    drop(permit);
                });
            }
            Err(e) => {
                drop(permit);
                tokio::time::sleep(backoff.failed(&e)).await;
            }
        }
    }
}

/// What a request asks for, as far as this endpoint cares.
#[derive(Debug, PartialEq, Eq)]
enum Asked {
    /// `GET /metrics` (or `HEAD`: the same without the body).
    Metrics {
        head_only: bool,
    },
    NotFound,
    MethodNotAllowed,
    BadRequest,
    TooLarge,
}

/// Reads one request, writes one response, and closes.
async fn answer(mut stream: TcpStream, handle: &PrometheusHandle, timeout: Duration) {
    let request = match tokio::time::timeout(timeout, read_head(&mut stream)).await {
        Ok(Some(request)) => request,
        // The client left before a whole head came.
        Ok(None) => return,
        Err(_) => {
            let _ = tokio::time::timeout(
                timeout,
                stream.write_all(&response("408 Request Timeout", "", "request timeout\n")),
            )
            .await;
            return;
        }
    };
    let reply = match request {
        Asked::Metrics { head_only } => {
            let body = handle.render();
            let mut reply = response("200 OK", "text/plain; version=0.0.4; charset=utf-8", &body);
            if head_only {
                reply.truncate(reply.len() - body.len());
            }
            reply
        }
        Asked::NotFound => response("404 Not Found", "", "only /metrics is served here\n"),
        Asked::MethodNotAllowed => response(
            "405 Method Not Allowed\r\nAllow: GET, HEAD",
            "",
            "only GET is allowed\n",
        ),
        Asked::BadRequest => response("400 Bad Request", "", "bad request\n"),
        Asked::TooLarge => response(
            "431 Request Header Fields Too Large",
            "",
            "request head too large\n",
        ),
    };
    let _ = tokio::time::timeout(timeout, async {
        stream.write_all(&reply).await?;
        stream.shutdown().await?;
        // Closing with unread bytes (the rest of an oversized head, a body)
        // would reset the connection, and the client might lose the
        // response: read what it still sends, up to a bound, until it
        // closes too.
        let mut rest = (&mut stream).take(DRAIN_MAX as u64);
        tokio::io::copy(&mut rest, &mut tokio::io::sink()).await
    })
    .await;
}

/// Reads up to the end of the request head (an empty line) and parses it;
/// `None` if the client closed before that.
async fn read_head(stream: &mut TcpStream) -> Option<Asked> {
    let mut buf = vec![0u8; MAX_HEAD];
    let mut len = 0;
    loop {
        if len == buf.len() {
            return Some(Asked::TooLarge);
        }
        let n = stream.read(&mut buf[len..]).await.ok()?;
        if n == 0 {
            return None;
        }
        // The end may straddle two reads.
        let from = len.saturating_sub(3);
        len += n;
        if let Some(end) = head_end(&buf[from..len]) {
            return Some(parse(&buf[..from + end]));
        }
    }
}

/// Where the head ends (after `\r\n\r\n`, or `\n\n` from lax clients).
fn head_end(buf: &[u8]) -> Option<usize> {
    (0..buf.len()).find_map(|i| {
        if buf[i..].starts_with(b"\r\n\r\n") {
            Some(i + 4)
        } else if buf[i..].starts_with(b"\n\n") {
            Some(i + 2)
        } else {
            None
        }
    })
}

/// The request line decides; headers are not looked at.
fn parse(head: &[u8]) -> Asked {
    let line_end = head.iter().position(|&b| b == b'\n').unwrap_or(head.len());
    let Ok(line) = std::str::from_utf8(&head[..line_end]) else {
        return Asked::BadRequest;
    };
    let mut parts = line.trim_end_matches('\r').split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Asked::BadRequest;
    };
    if !version.starts_with("HTTP/1.") || method.is_empty() || !target.starts_with('/') {
        return Asked::BadRequest;
    }
    let path = target.split('?').next().unwrap_or(target);
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => return Asked::MethodNotAllowed,
    };
    if path == "/metrics" {
        Asked::Metrics { head_only }
    } else {
        Asked::NotFound
    }
}

/// A whole response; `status` may carry extra header lines.
fn response(status: &str, content_type: &str, body: &str) -> Vec<u8> {
    let content_type = if content_type.is_empty() {
        "text/plain; charset=utf-8"
    } else {
        content_type
    };
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body.as_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_told_apart_by_their_request_line() {
        let p = |s: &str| parse(s.as_bytes());
        assert_eq!(
            p("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
            Asked::Metrics { head_only: false }
        );
        assert_eq!(
            p("GET /metrics?x=1 HTTP/1.0\r\n\r\n"),
            Asked::Metrics { head_only: false }
        );
        assert_eq!(
            p("HEAD /metrics HTTP/1.1\r\n\r\n"),
            Asked::Metrics { head_only: true }
        );
        assert_eq!(p("GET / HTTP/1.1\r\n\r\n"), Asked::NotFound);
        assert_eq!(p("GET /metricsx HTTP/1.1\r\n\r\n"), Asked::NotFound);
        assert_eq!(p("POST /metrics HTTP/1.1\r\n\r\n"), Asked::MethodNotAllowed);
        assert_eq!(p("DELETE /other HTTP/1.1\r\n\r\n"), Asked::MethodNotAllowed);
        for bad in [
            "hello\r\n\r\n",
            "GET /metrics\r\n\r\n",
            "GET /metrics HTTP/2\r\n\r\n",
            "GET metrics HTTP/1.1\r\n\r\n",
            "GET  /metrics HTTP/1.1\r\n\r\n",
            "GET /metrics HTTP/1.1 x\r\n\r\n",
        ] {
            assert_eq!(p(bad), Asked::BadRequest, "{bad:?}");
        }
        assert_eq!(parse(b"GET /\xff HTTP/1.1\r\n\r\n"), Asked::BadRequest);
    }

    #[test]
    fn the_head_ends_at_an_empty_line() {
        assert_eq!(head_end(b"GET / HTTP/1.1\r\n\r\n"), Some(18));
        assert_eq!(head_end(b"GET / HTTP/1.1\n\n"), Some(16));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nHost: x\r\n"), None);
    }

    /// The endpoint on a port of its own, with a recorder that is not
    /// installed globally.
    async fn endpoint(limits: Limits) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        tokio::spawn(serve(listener, recorder.handle(), limits));
        addr
    }

    async fn get(addr: std::net::SocketAddr) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn a_head_split_across_reads_is_read_whole() {
        let addr = endpoint(Limits {
            max_connections: 4,
            timeout: Duration::from_secs(10),
        })
        .await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        for part in ["GET /metrics HTTP/1.1\r", "\nHost: x\r\n\r", "\n"] {
            s.write_all(part.as_bytes()).await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        assert!(out.starts_with("HTTP/1.1 200 OK\r\n"), "{out}");
    }

    #[tokio::test]
    async fn a_silent_connection_is_closed_after_the_timeout() {
        let addr = endpoint(Limits {
            max_connections: 4,
            timeout: Duration::from_millis(200),
        })
        .await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        let mut out = String::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut out))
            .await
            .expect("closed by the endpoint")
            .unwrap();
        assert!(out.starts_with("HTTP/1.1 408"), "{out}");
    }

    #[tokio::test]
    async fn connections_beyond_the_bound_wait_for_a_free_one() {
        let addr = endpoint(Limits {
            max_connections: 2,
            timeout: Duration::from_secs(60),
        })
        .await;
        let mut silent = vec![
            TcpStream::connect(addr).await.unwrap(),
            TcpStream::connect(addr).await.unwrap(),
        ];
        let third = tokio::spawn(get(addr));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!third.is_finished(), "served beyond max_connections");
        // One of the two leaves: the third is served.
        silent.pop();
        let out = tokio::time::timeout(Duration::from_secs(10), third)
            .await
            .expect("served once a connection is free")
            .unwrap();
        assert!(out.starts_with("HTTP/1.1 200 OK\r\n"), "{out}");
    }
}
