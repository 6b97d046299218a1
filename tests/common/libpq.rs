//! A TLS client that reads the way libpq does (PostgreSQL 15's
//! `pqReadData` over OpenSSL, which reads one TLS record at a time) and
//! waits the way applications on libpq's asynchronous API do (psycopg:
//! `PQconsumeInput`, `PQisBusy`, then poll the socket). Such a client never
//! looks at plaintext a TLS library has decrypted but not handed over: if a
//! record holds more than libpq asked for, the rest waits inside TLS while
//! the client waits on a quiet socket. PostgreSQL writes records of at most
//! 8192 bytes and libpq always asks for at least that much, so against
//! PostgreSQL this never happens; a server that writes larger records hangs
//! such clients (libpq before PostgreSQL 18 and its back-patches).
//!
//! Everything here is blocking (std sockets, `poll(2)`); every wait on the
//! socket is bounded, and a quiet socket with plaintext waiting inside TLS
//! fails the test with that diagnosis instead of hanging it.

use super::tls::tls_connect;
use super::wire::{read_message, startup_packet};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// libpq's minimum free input space before a read (`pqReadData`).
const MIN_READ_SPACE: usize = 8192;
/// libpq's initial input buffer (`PQconnectStart`).
const INITIAL_BUFFER: usize = 16384;
/// The longest the client waits for the socket before calling it a hang.
const QUIET_LIMIT: Duration = Duration::from_secs(5);

pub struct LibpqClient {
    tcp: TcpStream,
    tls: rustls::ClientConnection,
    /// The TLS record being read from the socket (header, then body).
    record: Vec<u8>,
    /// libpq's input buffer: messages in `buf[start..end]`.
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// The most plaintext one record from the server carried.
    pub largest_record: usize,
}

/// The result of a simple query, as counted by the client.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    pub rows: usize,
    /// Bytes of DataRow / CopyData bodies.
    pub bytes: usize,
    /// The last CommandComplete tag.
    pub tag: String,
    /// The CopyData bodies of a COPY TO STDOUT, in order.
    pub copied: Vec<u8>,
}

impl LibpqClient {
    /// SSLRequest, TLS handshake, startup as `user` to database `app` (usher
    /// must let the user in with `trust`), up to the first ReadyForQuery;
    /// then the connection is handed to the blocking client.
    pub async fn connect(addr: SocketAddr, ca_pem: &str, user: &str) -> LibpqClient {
        let mut tls = tls_connect(addr, ca_pem).await;
        tls.write_all(&startup_packet(&[("user", user), ("database", "app")]))
            .await
            .unwrap();
        loop {
            match read_message(&mut tls).await {
                (b'Z', _) => break,
                (b'E', body) => panic!("login failed: {}", String::from_utf8_lossy(&body)),
                _ => {}
            }
        }
        let (tcp, conn) = tls.into_inner();
        let tcp = tcp.into_std().unwrap();
        tcp.set_nonblocking(true).unwrap();
        LibpqClient {
            tcp,
            tls: conn,
            record: Vec::new(),
            buf: vec![0; INITIAL_BUFFER],
            start: 0,
            end: 0,
            largest_record: 0,
        }
    }

    /// Sends a message (tag and body), waiting for the socket as needed.
    pub fn send(&mut self, tag: u8, body: &[u8]) {
        let mut m = vec![tag];
        m.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
        m.extend_from_slice(body);
        let mut rest = &m[..];
        while !rest.is_empty() {
            // rustls takes as much as its outgoing buffer has room for.
            let n = self.tls.writer().write(rest).unwrap();
            rest = &rest[n..];
            while self.tls.wants_write() {
                match self.tls.write_tls(&mut self.tcp) {
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        assert!(
                            self.poll(libc::POLLOUT),
                            "usher read nothing from the client for {QUIET_LIMIT:?}"
                        );
                    }
                    Err(e) => panic!("write to usher: {e}"),
                }
            }
        }
    }

    /// A simple query; panics on an ErrorResponse or a hang.
    pub fn query(&mut self, sql: &str) -> Outcome {
        self.send(b'Q', &cstr(sql));
        self.until_ready()
    }

    /// `COPY ... TO STDOUT`: the rows' bytes come back as CopyData.
    pub fn copy_out(&mut self, sql: &str) -> Outcome {
        self.query(sql)
    }

    /// `COPY ... FROM STDIN` with these CopyData chunks.
    pub fn copy_in(&mut self, sql: &str, chunks: &[Vec<u8>]) -> Outcome {
        self.send(b'Q', &cstr(sql));
        let (tag, body) = self.message();
        assert_eq!(tag, b'G', "CopyInResponse, got {}", describe(tag, &body));
        for chunk in chunks {
            self.send(b'd', chunk);
        }
        self.send(b'c', &[]);
        self.until_ready()
    }

    /// Sends Terminate.
    pub fn close(mut self) {
        self.send(b'X', &[]);
    }

    fn until_ready(&mut self) -> Outcome {
        let mut out = Outcome::default();
        loop {
            let (tag, body) = self.message();
            match tag {
                b'D' => {
                    out.rows += 1;
                    out.bytes += body.len();
                }
                b'd' => {
                    out.rows += 1;
                    out.bytes += body.len();
                    out.copied.extend_from_slice(&body);
                }
                b'C' => out.tag = String::from_utf8_lossy(&body[..body.len() - 1]).into_owned(),
                b'E' => panic!("{}", describe(tag, &body)),
                b'Z' => return out,
                _ => {}
            }
        }
    }

    /// The next whole message: parse what is buffered; else wait for the
    /// socket (as psycopg does when `PQisBusy`) and read (`PQconsumeInput`).
    fn message(&mut self) -> (u8, Vec<u8>) {
        loop {
            if let Some(m) = self.parse() {
                return m;
            }
            if !self.poll(libc::POLLIN) {
                let held = self
                    .tls
                    .process_new_packets()
                    .map(|s| s.plaintext_bytes_to_read())
                    .unwrap_or(0);
                panic!(
                    "the socket stayed quiet for {QUIET_LIMIT:?} with {held} bytes of plaintext \
                     decrypted but held inside TLS (the largest record carried {} bytes; libpq \
                     asks for at least {MIN_READ_SPACE}): a libpq client waits here forever",
                    self.largest_record
                );
            }
            self.read_data();
        }
    }

    /// One message off the buffer if it is whole; if not, make room for it
    /// (libpq's `pqCheckInBufferSpace` from `pqParseInput3`).
    fn parse(&mut self) -> Option<(u8, Vec<u8>)> {
        let have = self.end - self.start;
        if have < 5 {
            return None;
        }
        let b = &self.buf[self.start..self.end];
        let len = u32::from_be_bytes(b[1..5].try_into().unwrap()) as usize;
        if have < 1 + len {
            self.make_room(self.start + 1 + len);
            return None;
        }
        let m = (b[0], b[5..1 + len].to_vec());
        self.start += 1 + len;
        Some(m)
    }

    /// libpq's `pqReadData`: left-justify, keep at least 8 KB free, read;
    /// read again at once only while a long message is coming in.
    fn read_data(&mut self) {
        self.left_justify();
        if self.buf.len() - self.end < MIN_READ_SPACE {
            self.make_room(self.end + MIN_READ_SPACE);
        }
        loop {
            let end = self.end;
            let n = self.ssl_read(end);
            if n == 0 {
                return;
            }
            self.end += n;
            if !(self.end > 32768 && self.buf.len() - self.end >= MIN_READ_SPACE) {
                return;
            }
        }
    }

    /// `SSL_read` into `buf[at..]`: plaintext of the current record, else
    /// the next record from the socket, read alone (no read-ahead). 0 when
    /// the socket has no whole record yet.
    fn ssl_read(&mut self, at: usize) -> usize {
        loop {
            match self.tls.reader().read(&mut self.buf[at..]) {
                Ok(0) => panic!("usher closed the TLS connection"),
                Ok(n) => return n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("TLS read: {e}"),
            }
            let want = if self.record.len() < 5 {
                5
            } else {
                5 + u16::from_be_bytes([self.record[3], self.record[4]]) as usize
            };
            let have = self.record.len();
            self.record.resize(want, 0);
            match self.tcp.read(&mut self.record[have..]) {
                Ok(0) => panic!("usher closed the connection"),
                Ok(n) => self.record.truncate(have + n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.record.truncate(have);
                    return 0;
                }
                Err(e) => panic!("socket read: {e}"),
            }
            if self.record.len() > 5 && self.record.len() == want {
                // (rustls takes at most a few KB per call)
                let mut rest = &self.record[..];
                while !rest.is_empty() {
                    self.tls.read_tls(&mut rest).unwrap();
                }
                let state = self.tls.process_new_packets().expect("valid TLS");
                self.largest_record = self.largest_record.max(state.plaintext_bytes_to_read());
                self.record.clear();
            }
        }
    }

    /// libpq's `pqCheckInBufferSpace`: room for `needed` bytes from the
    /// buffer's start, left-justifying before it grows (doubling).
    fn make_room(&mut self, needed: usize) {
        if needed <= self.buf.len() {
            return;
        }
        let needed = needed - self.start;
        self.left_justify();
        let mut size = self.buf.len();
        while size < needed {
            size *= 2;
        }
        self.buf.resize(size, 0);
    }

    fn left_justify(&mut self) {
        if self.start < self.end {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
        } else {
            self.end = 0;
        }
        self.start = 0;
    }

    /// Waits for the socket (bounded); false if it stayed quiet.
    fn poll(&self, events: libc::c_short) -> bool {
        let mut p = libc::pollfd {
            fd: self.tcp.as_raw_fd(),
            events,
            revents: 0,
        };
        let n = unsafe { libc::poll(&mut p, 1, QUIET_LIMIT.as_millis() as libc::c_int) };
        assert!(n >= 0, "poll: {}", io::Error::last_os_error());
        n > 0
    }
}

fn cstr(s: &str) -> Vec<u8> {
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    v
}

fn describe(tag: u8, body: &[u8]) -> String {
    format!(
        "message {:?}: {}",
        tag as char,
        String::from_utf8_lossy(body).replace('\0', " ")
    )
}
