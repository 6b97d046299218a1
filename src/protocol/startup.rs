//! The first packet a client sends: it has no type byte, only a length and a
//! code that says what it is. Read and checked as PostgreSQL 15 does
//! (postmaster.c, ProcessStartupPacket): the same limits, the same layout
//! rules, the same errors, and the same silence where PostgreSQL only logs.

use super::error::{sqlstate, PgError};
use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};

pub const PROTOCOL_3_0: u32 = 196_608;
pub const SSL_REQUEST: u32 = 80_877_103;
pub const GSSENC_REQUEST: u32 = 80_877_104;
pub const CANCEL_REQUEST: u32 = 80_877_102;

/// The longest packet body after the length word (PostgreSQL's
/// MAX_STARTUP_PACKET_LENGTH): a packet may be 10,004 bytes in all.
pub const MAX_STARTUP_PACKET: usize = 10_000;

/// PostgreSQL truncates user and database names to NAMEDATALEN - 1 bytes.
pub const MAX_NAME_BYTES: usize = 63;

/// What the client's first packet asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartupPacket {
    /// A protocol 3.x startup message.
    Startup(StartupMessage),
    SslRequest,
    GssEncRequest,
    Cancel {
        pid: u32,
        secret: u32,
    },
    /// Another code: a protocol version usher does not speak, or a request
    /// it does not know. What to answer depends on what came before (a
    /// second SSLRequest is refused as an unsupported version).
    Other(u32),
}

/// A protocol 3.x startup message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartupMessage {
    /// The minor version asked for; usher serves 3.0 whatever it is.
    pub minor: u16,
    /// The parameters in the order sent; a name sent twice keeps its last
    /// value (as PostgreSQL). `_pq_.` options are not among them.
    pub params: Vec<(String, String)>,
    /// `_pq_.` protocol options, none of which usher knows.
    pub protocol_options: Vec<String>,
}

impl StartupMessage {
    /// True when the client must be told NegotiateProtocolVersion.
    pub fn needs_negotiation(&self) -> bool {
        self.minor > 0 || !self.protocol_options.is_empty()
    }
}

impl StartupPacket {
    /// A startup parameter by name.
    pub fn param<'a>(params: &'a [(String, String)], name: &str) -> Option<&'a str> {
        params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// PostgreSQL's COMMERROR for the packet framing: logged, nothing sent.
fn framing(message: &'static str) -> PgError {
    PgError::server_only(sqlstate::PROTOCOL_VIOLATION, message)
}

/// Reads one startup-phase packet. `Ok(None)` means the client closed the
/// connection before sending anything. Framing errors (a bad length, a
/// packet cut short) are server-only errors: PostgreSQL answers them with
/// nothing but closing the connection (and a line in its log).
pub async fn read_startup<R: AsyncRead + Unpin>(
    reader: &mut R,
) -> Result<Option<StartupPacket>, PgError> {
    let mut len_buf = [0u8; 4];
    // The first byte alone: no data at all is a client that changed its
    // mind, not an error; part of a length word is.
    match reader.read(&mut len_buf[..1]).await {
        Ok(0) => return Ok(None),
        Ok(_) => {}
        Err(_) => return Err(framing("could not receive data from client")),
    }
    reader
        .read_exact(&mut len_buf[1..])
        .await
        .map_err(|_| framing("incomplete startup packet"))?;
    let len = (u32::from_be_bytes(len_buf) as usize).wrapping_sub(4);
    if !(4..=MAX_STARTUP_PACKET).contains(&len) {
        return Err(framing("invalid length of startup packet"));
    }
    let mut body = BytesMut::zeroed(len);
    reader
        .read_exact(&mut body)
        .await
        .map_err(|_| framing("incomplete startup packet"))?;
    parse_startup_body(body).map(Some)
}

/// Parses the body of a startup-phase packet (everything after the length).
pub fn parse_startup_body(mut body: BytesMut) -> Result<StartupPacket, PgError> {
    if body.len() < 4 {
        return Err(framing("invalid length of startup packet"));
    }
    let code = body.get_u32();
    match code {
        // Extra bytes after a request code are ignored, as PostgreSQL does.
        SSL_REQUEST => Ok(StartupPacket::SslRequest),
        GSSENC_REQUEST => Ok(StartupPacket::GssEncRequest),
        CANCEL_REQUEST if body.len() == 8 => {
            let pid = body.get_u32();
            let secret = body.get_u32();
            Ok(StartupPacket::Cancel { pid, secret })
        }
        CANCEL_REQUEST => Err(framing("invalid length of startup packet")),
        code if code >> 16 == 3 => parse_parameters(code as u16, &body).map(StartupPacket::Startup),
        other => Ok(StartupPacket::Other(other)),
    }
}

/// The error for a version (or request code) usher does not speak.
pub fn unsupported_version(code: u32) -> PgError {
    PgError::fatal(
        sqlstate::FEATURE_NOT_SUPPORTED,
        format!(
            "unsupported frontend protocol {}.{}: server supports 3.0 to 3.0",
            code >> 16,
            code & 0xffff
        ),
    )
}

/// PostgreSQL answers a protocol 1.x or 2.x client (any code below 3.0
/// but 0) in the old format: `E`, then the text, no length.
pub fn old_format_error(code: u32) -> Option<Vec<u8>> {
    if code == 0 || code >> 16 >= 3 {
        return None;
    }
    let mut out = b"EFATAL:  ".to_vec();
    out.extend_from_slice(unsupported_version(code).message.as_bytes());
    out.extend_from_slice(b"\n\0");
    Some(out)
}

/// Name/value pairs up to the empty name that ends them, which must be the
/// last byte.
fn parse_parameters(minor: u16, body: &[u8]) -> Result<StartupMessage, PgError> {
    let layout =
        || PgError::protocol("invalid startup packet layout: expected terminator as last byte");
    let mut params: Vec<(String, String)> = Vec::new();
    let mut protocol_options = Vec::new();
    let mut rest = body;
    loop {
        // Each string ends at a NUL; one that runs to the end of the packet
        // has no terminator after it, which the layout check refuses.
        let Some(end) = rest.iter().position(|b| *b == 0) else {
            return Err(layout());
        };
        let name = &rest[..end];
        rest = &rest[end + 1..];
        if name.is_empty() {
            // The terminator: it must be the last byte.
            return if rest.is_empty() {
                Ok(StartupMessage {
                    minor,
                    params,
                    protocol_options,
                })
            } else {
                Err(layout())
            };
        }
        let Some(end) = rest.iter().position(|b| *b == 0) else {
            return Err(layout());
        };
        let value = &rest[..end];
        rest = &rest[end + 1..];
        let name = std::str::from_utf8(name).map_err(|_| {
            PgError::protocol("invalid startup packet: a parameter name is not valid UTF-8")
        })?;
        if name.starts_with("_pq_.") {
            protocol_options.push(name.to_string());
            continue;
        }
        let mut value = std::str::from_utf8(value)
            .map_err(|_| {
                PgError::protocol(format!(
                    "invalid startup packet: the value of parameter \"{}\" is not valid UTF-8",
                    super::error::shown(name, MAX_NAME_BYTES)
                ))
            })?
            .to_string();
        match name {
            "user" | "database" => truncate(&mut value, MAX_NAME_BYTES),
            "replication" => value = replication(&value)?,
            _ => {}
        }
        match params.iter_mut().find(|(k, _)| k == name) {
            Some((_, v)) => *v = value,
            None => params.push((name.to_string(), value)),
        }
    }
}

/// Cuts `s` to at most `max` bytes, at a character boundary.
fn truncate(s: &mut String, max: usize) {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
}

/// The `replication` value as PostgreSQL reads it (a boolean, or
/// `database`), spelt `false`, `true` or `database`.
fn replication(value: &str) -> Result<String, PgError> {
    if value.eq_ignore_ascii_case("database") {
        return Ok("database".into());
    }
    match parse_bool(value) {
        Some(b) => Ok(b.to_string()),
        None => Err(PgError::fatal(
            sqlstate::INVALID_PARAMETER_VALUE,
            format!(
                "invalid value for parameter \"replication\": \"{}\"",
                super::error::shown(value, MAX_NAME_BYTES)
            ),
        )
        .with_hint("Valid values are: \"false\", 0, \"true\", 1, \"database\".")),
    }
}

/// PostgreSQL's parse_bool: true/false, yes/no (or a prefix of them), on,
/// off (at least two letters), 1, 0; case-insensitive.
fn parse_bool(value: &str) -> Option<bool> {
    let v = value.to_ascii_lowercase();
    let prefix = |word: &str, min: usize| v.len() >= min && word.starts_with(v.as_str());
    if prefix("true", 1) || prefix("yes", 1) || prefix("on", 2) || v == "1" {
        Some(true)
    } else if prefix("false", 1) || prefix("no", 1) || prefix("off", 2) || v == "0" {
        Some(false)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BufMut;

    fn packet(code: u32, rest: &[u8]) -> BytesMut {
        let mut b = BytesMut::new();
        b.put_u32(code);
        b.put_slice(rest);
        b
    }

    fn startup(rest: &[u8]) -> Result<StartupMessage, PgError> {
        match parse_startup_body(packet(PROTOCOL_3_0, rest))? {
            StartupPacket::Startup(m) => Ok(m),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn parses_startup_parameters() {
        let m = startup(b"user\0alice\0database\0app\0\0").unwrap();
        assert_eq!(StartupPacket::param(&m.params, "user"), Some("alice"));
        assert_eq!(StartupPacket::param(&m.params, "database"), Some("app"));
        assert!(!m.needs_negotiation());
    }

    #[test]
    fn a_name_sent_twice_keeps_its_last_value() {
        let m = startup(b"user\0alice\0TimeZone\0UTC\0user\0bob\0\0").unwrap();
        assert_eq!(
            m.params,
            [
                ("user".into(), "bob".into()),
                ("TimeZone".into(), "UTC".into())
            ]
        );
    }

    #[test]
    fn user_and_database_are_cut_to_63_bytes() {
        let long = format!(
            "user\0{}é\0database\0{}\0\0",
            "a".repeat(62),
            "d".repeat(70)
        );
        let m = startup(long.as_bytes()).unwrap();
        // The é would straddle byte 63: cut before it.
        assert_eq!(
            StartupPacket::param(&m.params, "user").unwrap(),
            "a".repeat(62)
        );
        assert_eq!(
            StartupPacket::param(&m.params, "database").unwrap(),
            "d".repeat(63)
        );
    }

    #[test]
    fn newer_minor_versions_and_pq_options_need_negotiation() {
        let m = match parse_startup_body(packet(3 << 16 | 2, b"user\0a\0\0")).unwrap() {
            StartupPacket::Startup(m) => m,
            other => panic!("{other:?}"),
        };
        assert_eq!(m.minor, 2);
        assert!(m.needs_negotiation());
        let m = startup(b"_pq_.x\0y\0user\0a\0\0").unwrap();
        assert_eq!(m.protocol_options, ["_pq_.x"]);
        assert_eq!(m.params, [("user".into(), "a".into())]);
        assert!(m.needs_negotiation());
    }

    #[test]
    fn other_versions_are_left_to_the_caller() {
        for code in [2 << 16, 4 << 16, 0] {
            assert_eq!(
                parse_startup_body(packet(code, b"")).unwrap(),
                StartupPacket::Other(code)
            );
        }
        let e = unsupported_version(4 << 16 | 1);
        assert_eq!(e.code, "0A000");
        assert_eq!(
            e.message,
            "unsupported frontend protocol 4.1: server supports 3.0 to 3.0"
        );
        assert!(old_format_error(0).is_none());
        assert!(old_format_error(3 << 16).is_none());
        assert_eq!(
            old_format_error(2 << 16).unwrap(),
            b"EFATAL:  unsupported frontend protocol 2.0: server supports 3.0 to 3.0\n\0"
        );
    }

    #[test]
    fn refuses_garbled_parameters() {
        for body in [
            &b"user\0alice"[..],
            b"user\0",
            b"user",
            b"",
            b"user\0alice\0",
            b"user\0alice\0\0x\0",
            b"user\0alice\0\0\0",
            b"\0user\0alice\0\0",
        ] {
            let e = startup(body).unwrap_err();
            assert_eq!(e.code, "08P01", "{body:?}");
            assert!(e.message.contains("expected terminator"), "{body:?}");
        }
        // An empty user is the caller's to refuse (after NegotiateProtocolVersion).
        assert!(startup(b"\0").unwrap().params.is_empty());
    }

    #[test]
    fn reads_replication_as_postgresql_does() {
        for (v, read) in [
            ("off", "false"),
            ("n", "false"),
            ("0", "false"),
            ("FALSE", "false"),
            ("on", "true"),
            ("yes", "true"),
            ("Database", "database"),
        ] {
            let m = startup(format!("user\0a\0replication\0{v}\0\0").as_bytes()).unwrap();
            assert_eq!(
                StartupPacket::param(&m.params, "replication"),
                Some(read),
                "{v}"
            );
        }
        for v in ["o", "maybe", "2", ""] {
            let e = startup(format!("user\0a\0replication\0{v}\0\0").as_bytes()).unwrap_err();
            assert_eq!(e.code, "22023", "{v}");
        }
    }

    #[tokio::test]
    async fn framing_errors_are_not_sent() {
        for bytes in [
            &b"X\0\0\0\x04"[..],
            b"\0\0\0\x04",
            b"\0\0\0\x07abc",
            b"\0\0",
            b"\0\0\0\x20abcd",
            b"\0\0\x27\x15",
        ] {
            let mut r = bytes;
            let e = read_startup(&mut r).await.unwrap_err();
            assert!(e.is_server_only(), "{bytes:?}");
            assert_eq!(e.code, "08P01");
        }
        let mut r = &b""[..];
        assert_eq!(read_startup(&mut r).await.unwrap(), None);
    }

    #[test]
    fn a_body_too_short_for_a_code_is_an_error() {
        // Found by fuzzing (fuzz/fuzz_targets/startup.rs): this panicked.
        for body in [&b""[..], b"\x00\x03\x00"] {
            let e = parse_startup_body(BytesMut::from(body)).unwrap_err();
            assert_eq!(e.code, "08P01");
        }
    }

    #[test]
    fn parses_cancel_and_ssl() {
        let mut rest = BytesMut::new();
        rest.put_u32(7);
        rest.put_u32(9);
        assert_eq!(
            parse_startup_body(packet(CANCEL_REQUEST, &rest)).unwrap(),
            StartupPacket::Cancel { pid: 7, secret: 9 }
        );
        assert!(parse_startup_body(packet(CANCEL_REQUEST, b""))
            .unwrap_err()
            .is_server_only());
        assert_eq!(
            parse_startup_body(packet(SSL_REQUEST, b"")).unwrap(),
            StartupPacket::SslRequest
        );
        assert_eq!(
            parse_startup_body(packet(SSL_REQUEST, b"1234")).unwrap(),
            StartupPacket::SslRequest
        );
    }
}
