//! A raw-protocol client that keeps every message the server sends, in
//! order: ParameterStatus after login included (tokio-postgres hands those
//! to its connection, not to the caller). For comparing what a client sees
//! through usher with what it sees on a direct connection to PostgreSQL:
//! it logs in without a password (usher with `auth.method: trust`, or
//! PostgreSQL's Unix socket, `trust` in the test cluster).

use super::wire::{message, startup_packet};
use std::path::Path;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// A message from the server, as a test compares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    Parameter(String, String),
    /// RowDescription: each column's name, type OID and type modifier.
    Columns(Vec<(String, u32, i32)>),
    /// ParameterDescription: the parameters' type OIDs.
    ParameterTypes(Vec<u32>),
    /// A row, values as text (NULL as `None`).
    Row(Vec<Option<String>>),
    Complete(String),
    /// SQLSTATE and message.
    Error(String, String),
    /// Severity, SQLSTATE and message.
    Notice(String, String, String),
    Ready(char),
    EmptyQuery,
    ParseComplete,
    BindComplete,
    CloseComplete,
    PortalSuspended,
    NoData,
    /// Anything else, by its tag (BackendKeyData, AuthenticationOk...).
    Other(char),
}

trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<S: AsyncRead + AsyncWrite + Unpin + Send> Stream for S {}

pub struct RawClient {
    stream: Box<dyn Stream>,
}

impl RawClient {
    /// Logs in over TCP with `params` (user, database, options...);
    /// returns the client and what the server sent up to ReadyForQuery.
    pub async fn tcp(addr: std::net::SocketAddr, params: &[(&str, &str)]) -> (RawClient, Vec<Msg>) {
        let s = tokio::net::TcpStream::connect(addr).await.unwrap();
        RawClient::login(Box::new(s), params).await
    }

    /// The same over PostgreSQL's Unix socket in `dir`.
    pub async fn unix(dir: &Path, port: u16, params: &[(&str, &str)]) -> (RawClient, Vec<Msg>) {
        let path = dir.join(format!(".s.PGSQL.{port}"));
        let s = tokio::net::UnixStream::connect(&path).await.unwrap();
        RawClient::login(Box::new(s), params).await
    }

    async fn login(stream: Box<dyn Stream>, params: &[(&str, &str)]) -> (RawClient, Vec<Msg>) {
        let mut c = RawClient { stream };
        c.stream.write_all(&startup_packet(params)).await.unwrap();
        let got = c.until_ready().await;
        assert!(
            !got.iter().any(|m| matches!(m, Msg::Error(..))),
            "login failed: {got:?}"
        );
        (c, got)
    }

    /// A Query; what came back, up to and with its ReadyForQuery.
    pub async fn query(&mut self, sql: &str) -> Vec<Msg> {
        let mut body = sql.as_bytes().to_vec();
        body.push(0);
        self.stream.write_all(&message(b'Q', &body)).await.unwrap();
        self.until_ready().await
    }

    /// One statement with the extended protocol (unnamed statement and
    /// portal: Parse, Bind, Describe, Execute, Sync).
    pub async fn extended(&mut self, sql: &str) -> Vec<Msg> {
        let mut out = Vec::new();
        let mut parse = vec![0];
        parse.extend_from_slice(sql.as_bytes());
        parse.extend_from_slice(&[0, 0, 0]);
        out.extend(message(b'P', &parse));
        out.extend(message(b'B', &[0, 0, 0, 0, 0, 0, 0, 0]));
        out.extend(message(b'D', b"P\0"));
        out.extend(message(b'E', &[0, 0, 0, 0, 0]));
        out.extend(message(b'S', &[]));
        self.stream.write_all(&out).await.unwrap();
        self.until_ready().await
    }

    /// Sends `bytes` as they are (whole messages, e.g.
    /// `wire::Frontend::encode`'s); an error if the connection is gone.
    pub async fn send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes).await
    }

    /// The next message, or `None` if none came `within` (or the
    /// connection closed): for tests that read answers one by one.
    pub async fn next(&mut self, within: Duration) -> Option<Msg> {
        let (tag, body) = tokio::time::timeout(within, async {
            let tag = self.stream.read_u8().await.ok()?;
            let len = self.stream.read_u32().await.ok()? as usize;
            let mut body = vec![0; len.checked_sub(4)?];
            self.stream.read_exact(&mut body).await.ok()?;
            Some((tag, body))
        })
        .await
        .ok()??;
        Some(parse(tag, &body))
    }

    /// Sends `messages` and reads the answers up to the ReadyForQuery of
    /// each Sync and Query among them.
    pub async fn batch(&mut self, messages: &[super::wire::Frontend]) -> Vec<Msg> {
        use super::wire::Frontend::{Query, Sync};
        let bytes: Vec<u8> = messages.iter().flat_map(|m| m.encode()).collect();
        self.send(&bytes).await.unwrap();
        let owed = messages
            .iter()
            .filter(|m| matches!(m, Sync | Query(_)))
            .count();
        let mut got = Vec::new();
        let mut ready = 0;
        while ready < owed {
            let m = self
                .next(Duration::from_secs(20))
                .await
                .expect("an answer within 20 s");
            ready += usize::from(matches!(m, Msg::Ready(_)));
            got.push(m);
        }
        got
    }

    /// Terminate, and the connection closed.
    pub async fn close(mut self) {
        let _ = self.stream.write_all(&message(b'X', &[])).await;
        let mut rest = Vec::new();
        let _ =
            tokio::time::timeout(Duration::from_secs(10), self.stream.read_to_end(&mut rest)).await;
    }

    async fn until_ready(&mut self) -> Vec<Msg> {
        let mut got = Vec::new();
        loop {
            let m = self.read().await;
            let done = matches!(m, Msg::Ready(_));
            got.push(m);
            if done {
                return got;
            }
        }
    }

    async fn read(&mut self) -> Msg {
        let (tag, body) = tokio::time::timeout(Duration::from_secs(30), async {
            let tag = self.stream.read_u8().await.expect("a message");
            let len = self.stream.read_u32().await.unwrap() as usize;
            let mut body = vec![0; len - 4];
            self.stream.read_exact(&mut body).await.unwrap();
            (tag, body)
        })
        .await
        .expect("a message within 30 s");
        parse(tag, &body)
    }
}

fn parse(tag: u8, body: &[u8]) -> Msg {
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let cstrs = |b: &[u8]| -> Vec<String> { b.split(|c| *c == 0).map(text).collect() };
    match tag {
        b'S' => {
            let parts = cstrs(body);
            Msg::Parameter(parts[0].clone(), parts[1].clone())
        }
        b'T' => {
            let n = u16::from_be_bytes([body[0], body[1]]) as usize;
            let mut at = 2;
            let mut columns = Vec::new();
            let int = |b: &[u8]| u32::from_be_bytes(b.try_into().unwrap());
            for _ in 0..n {
                let end = at + body[at..].iter().position(|c| *c == 0).unwrap();
                // name, table OID (4), column (2), type OID (4), size (2),
                // modifier (4), format (2)
                let fixed = &body[end + 1..end + 19];
                columns.push((
                    text(&body[at..end]),
                    int(&fixed[6..10]),
                    int(&fixed[12..16]) as i32,
                ));
                at = end + 19;
            }
            Msg::Columns(columns)
        }
        b't' => {
            let n = u16::from_be_bytes([body[0], body[1]]) as usize;
            Msg::ParameterTypes(
                (0..n)
                    .map(|i| u32::from_be_bytes(body[2 + 4 * i..6 + 4 * i].try_into().unwrap()))
                    .collect(),
            )
        }
        b'D' => {
            let n = u16::from_be_bytes([body[0], body[1]]) as usize;
            let mut at = 2;
            let mut values = Vec::new();
            for _ in 0..n {
                let len = i32::from_be_bytes(body[at..at + 4].try_into().unwrap());
                at += 4;
                if len < 0 {
                    values.push(None);
                } else {
                    values.push(Some(text(&body[at..at + len as usize])));
                    at += len as usize;
                }
            }
            Msg::Row(values)
        }
        b'C' => Msg::Complete(text(body.strip_suffix(&[0]).unwrap_or(body))),
        b'E' | b'N' => {
            let field = |code: u8| {
                body.split(|c| *c == 0)
                    .find(|f| f.first() == Some(&code))
                    .map(|f| text(&f[1..]))
                    .unwrap_or_default()
            };
            if tag == b'E' {
                Msg::Error(field(b'C'), field(b'M'))
            } else {
                Msg::Notice(field(b'V'), field(b'C'), field(b'M'))
            }
        }
        b'Z' => Msg::Ready(body[0] as char),
        b'I' => Msg::EmptyQuery,
        b'1' => Msg::ParseComplete,
        b'2' => Msg::BindComplete,
        b'3' => Msg::CloseComplete,
        b's' => Msg::PortalSuspended,
        b'n' => Msg::NoData,
        other => Msg::Other(other as char),
    }
}

/// The ParameterStatus values among `msgs`, by name (the last of each).
pub fn parameters(msgs: &[Msg]) -> std::collections::BTreeMap<String, String> {
    msgs.iter()
        .filter_map(|m| match m {
            Msg::Parameter(n, v) => Some((n.clone(), v.clone())),
            _ => None,
        })
        .collect()
}

/// The first value of the first row among `msgs` (NULL as "").
pub fn first_value(msgs: &[Msg]) -> String {
    msgs.iter()
        .find_map(|m| match m {
            Msg::Row(r) => Some(r[0].clone().unwrap_or_default()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no row in {msgs:?}"))
}

/// What a test compares of an answer: its messages in order without the
/// ParameterStatus ones, and those as a map (PostgreSQL reports changed
/// parameters in an order of its own, which is not part of the protocol).
pub fn comparable(msgs: &[Msg]) -> (Vec<Msg>, std::collections::BTreeMap<String, String>) {
    let others = msgs
        .iter()
        .filter(|m| !matches!(m, Msg::Parameter(..) | Msg::Other('K')))
        .cloned()
        .collect();
    (others, parameters(msgs))
}
