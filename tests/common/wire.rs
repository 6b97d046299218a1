//! Speaking the protocol by hand, for tests that need to send what a real
//! client would not: startup packets, SASL messages, errors read back.

use std::collections::HashMap;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

pub fn startup_packet(params: &[(&str, &str)]) -> Vec<u8> {
    let mut body = 196608u32.to_be_bytes().to_vec();
    for (k, v) in params {
        body.extend_from_slice(k.as_bytes());
        body.push(0);
        body.extend_from_slice(v.as_bytes());
        body.push(0);
    }
    body.push(0);
    let mut p = ((body.len() + 4) as u32).to_be_bytes().to_vec();
    p.extend(body);
    p
}

/// A typed message: tag, Int32 length, body.
pub fn message(tag: u8, body: &[u8]) -> Vec<u8> {
    let mut m = vec![tag];
    m.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
    m.extend_from_slice(body);
    m
}

/// SASLInitialResponse for SCRAM-SHA-256 with `data`.
pub fn sasl_initial(data: &[u8]) -> Vec<u8> {
    let mut body = b"SCRAM-SHA-256\0".to_vec();
    body.extend_from_slice(&(data.len() as i32).to_be_bytes());
    body.extend_from_slice(data);
    message(b'p', &body)
}

/// Reads one message (tag, body), failing the test after 10 s.
pub async fn read_message<S: AsyncRead + Unpin>(s: &mut S) -> (u8, Vec<u8>) {
    tokio::time::timeout(Duration::from_secs(10), async {
        let tag = s.read_u8().await.expect("a message");
        let len = s.read_u32().await.unwrap() as usize;
        let mut body = vec![0; len - 4];
        s.read_exact(&mut body).await.unwrap();
        (tag, body)
    })
    .await
    .expect("a message within 10 s")
}

/// Reads until the connection closes and returns the fields (code →
/// value) of the first ErrorResponse.
pub async fn read_error<S: AsyncRead + Unpin>(s: &mut S) -> HashMap<char, String> {
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf)).await;
    error_fields(&buf).unwrap_or_else(|| panic!("no ErrorResponse in {buf:?}"))
}

/// The fields of the first ErrorResponse among whole messages in `buf`.
pub fn error_fields(mut buf: &[u8]) -> Option<HashMap<char, String>> {
    while buf.len() >= 5 {
        let len = u32::from_be_bytes(buf[1..5].try_into().unwrap()) as usize;
        let body = buf.get(5..1 + len)?;
        if buf[0] == b'E' {
            return Some(
                body.split(|b| *b == 0)
                    .filter(|f| !f.is_empty())
                    .map(|f| (f[0] as char, String::from_utf8_lossy(&f[1..]).into_owned()))
                    .collect(),
            );
        }
        buf = &buf[1 + len..];
    }
    None
}

/// Sends the startup packet and returns the SASL mechanisms usher offers.
pub async fn start_sasl<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, user: &str) -> Vec<u8> {
    s.write_all(&startup_packet(&[("user", user), ("database", "app")]))
        .await
        .unwrap();
    let (tag, body) = read_message(s).await;
    assert_eq!(tag, b'R');
    assert_eq!(&body[..4], &10u32.to_be_bytes(), "AuthenticationSASL");
    body
}

/// A raw client of `addr` as alice in database `app`, logged in (the
/// server is on `trust`), at its first ReadyForQuery.
pub async fn trust_login(addr: impl tokio::net::ToSocketAddrs) -> tokio::net::TcpStream {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(&startup_packet(&[("user", "alice"), ("database", "app")]))
        .await
        .unwrap();
    loop {
        let (tag, body) = read_message(&mut s).await;
        assert_ne!(
            tag,
            b'E',
            "login failed: {}",
            String::from_utf8_lossy(&body)
        );
        if tag == b'Z' {
            return s;
        }
    }
}

/// A frontend message of the extended (or simple) query protocol, as a
/// test writes it: `encode` gives its bytes, Debug a readable form for
/// failure messages. Parameters and results are text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frontend {
    /// Statement name, text, parameter type OIDs (0: unspecified).
    Parse(String, String, Vec<u32>),
    /// Portal, statement, parameter values (NULL as `None`).
    Bind(String, String, Vec<Option<String>>),
    /// `'S'` (statement) or `'P'` (portal), and its name.
    Describe(char, String),
    /// Portal and row limit (0: all rows).
    Execute(String, u32),
    /// `'S'` or `'P'`, and its name.
    Close(char, String),
    Sync,
    Flush,
    Query(String),
}

impl Frontend {
    pub fn encode(&self) -> Vec<u8> {
        let cstr = |b: &mut Vec<u8>, s: &str| {
            b.extend_from_slice(s.as_bytes());
            b.push(0);
        };
        let mut b = Vec::new();
        match self {
            Frontend::Parse(name, sql, types) => {
                cstr(&mut b, name);
                cstr(&mut b, sql);
                b.extend_from_slice(&(types.len() as u16).to_be_bytes());
                for t in types {
                    b.extend_from_slice(&t.to_be_bytes());
                }
                message(b'P', &b)
            }
            Frontend::Bind(portal, statement, values) => {
                cstr(&mut b, portal);
                cstr(&mut b, statement);
                b.extend_from_slice(&0u16.to_be_bytes()); // all parameters text
                b.extend_from_slice(&(values.len() as u16).to_be_bytes());
                for v in values {
                    match v {
                        Some(v) => {
                            b.extend_from_slice(&(v.len() as i32).to_be_bytes());
                            b.extend_from_slice(v.as_bytes());
                        }
                        None => b.extend_from_slice(&(-1i32).to_be_bytes()),
                    }
                }
                b.extend_from_slice(&0u16.to_be_bytes()); // all results text
                message(b'B', &b)
            }
            Frontend::Describe(kind, name) | Frontend::Close(kind, name) => {
                b.push(*kind as u8);
                cstr(&mut b, name);
                let tag = if matches!(self, Frontend::Describe(..)) {
                    b'D'
                } else {
                    b'C'
                };
                message(tag, &b)
            }
            Frontend::Execute(portal, max_rows) => {
                cstr(&mut b, portal);
                b.extend_from_slice(&max_rows.to_be_bytes());
                message(b'E', &b)
            }
            Frontend::Sync => message(b'S', &[]),
            Frontend::Flush => message(b'H', &[]),
            Frontend::Query(sql) => {
                cstr(&mut b, sql);
                message(b'Q', &b)
            }
        }
    }
}
