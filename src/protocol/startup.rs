//! The first packet a client sends: it has no type byte, only a length and a
//! code that says what it is.

use super::error::PgError;
use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};

pub const PROTOCOL_3_0: u32 = 196_608;
pub const SSL_REQUEST: u32 = 80_877_103;
pub const GSSENC_REQUEST: u32 = 80_877_104;
pub const CANCEL_REQUEST: u32 = 80_877_102;

/// PostgreSQL refuses startup packets larger than this (MAX_STARTUP_PACKET_LENGTH).
pub const MAX_STARTUP_PACKET: usize = 10_000;

/// What the client's first packet asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartupPacket {
    /// Protocol 3.0 startup with its parameters, in the order sent.
    Startup(Vec<(String, String)>),
    SslRequest,
    GssEncRequest,
    Cancel {
        pid: u32,
        secret: u32,
    },
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

/// Reads one startup-phase packet. `Ok(None)` means the client closed the
/// connection before sending anything.
pub async fn read_startup<R: AsyncRead + Unpin>(
    reader: &mut R,
) -> Result<Option<StartupPacket>, PgError> {
    let mut len_buf = [0u8; 4];
    match reader.read_exact(&mut len_buf).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => {
            return Err(PgError::protocol(format!(
                "could not read startup packet: {e}"
            )))
        }
    }
    let len = u32::from_be_bytes(len_buf) as usize;
    if !(8..=MAX_STARTUP_PACKET).contains(&len) {
        return Err(PgError::protocol(format!(
            "invalid length of startup packet: {len} bytes (expected 8 to {MAX_STARTUP_PACKET})"
        )));
    }
    let mut body = BytesMut::zeroed(len - 4);
    reader
        .read_exact(&mut body)
        .await
        .map_err(|_| PgError::protocol("incomplete startup packet"))?;
    parse_startup_body(body)
}

/// Parses the body of a startup-phase packet (everything after the length).
pub fn parse_startup_body(mut body: BytesMut) -> Result<Option<StartupPacket>, PgError> {
    if body.len() < 4 {
        return Err(PgError::protocol("invalid length of startup packet"));
    }
    let code = body.get_u32();
    match code {
        SSL_REQUEST if body.is_empty() => Ok(Some(StartupPacket::SslRequest)),
        GSSENC_REQUEST if body.is_empty() => Ok(Some(StartupPacket::GssEncRequest)),
        CANCEL_REQUEST if body.len() == 8 => {
            let pid = body.get_u32();
            let secret = body.get_u32();
            Ok(Some(StartupPacket::Cancel { pid, secret }))
        }
        PROTOCOL_3_0 => parse_parameters(&body).map(|p| Some(StartupPacket::Startup(p))),
        SSL_REQUEST | GSSENC_REQUEST | CANCEL_REQUEST => {
            Err(PgError::protocol("invalid length of startup packet"))
        }
        other => Err(PgError::fatal(
            super::error::sqlstate::FEATURE_NOT_SUPPORTED,
            format!(
                "unsupported frontend protocol {}.{}: server supports 3.0 to 3.0",
                other >> 16,
                other & 0xffff
            ),
        )),
    }
}

fn parse_parameters(body: &[u8]) -> Result<Vec<(String, String)>, PgError> {
    let bad =
        || PgError::protocol("invalid startup packet layout: expected terminator as last byte");
    if body.last() != Some(&0) {
        return Err(bad());
    }
    let mut params = Vec::new();
    let mut parts = body[..body.len() - 1].split(|b| *b == 0);
    while let Some(name) = parts.next() {
        if name.is_empty() {
            // The list ends with an empty name; nothing may follow it.
            if parts.next().is_some() {
                return Err(bad());
            }
            break;
        }
        let value = parts.next().ok_or_else(bad)?;
        let text = |b: &[u8]| {
            String::from_utf8(b.to_vec())
                .map_err(|_| PgError::protocol("invalid startup packet: parameter is not UTF-8"))
        };
        params.push((text(name)?, text(value)?));
    }
    if StartupPacket::param(&params, "user").is_none_or(str::is_empty) {
        return Err(PgError::fatal(
            super::error::sqlstate::INVALID_AUTHORIZATION,
            "no PostgreSQL user name specified in startup packet",
        ));
    }
    Ok(params)
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

    #[test]
    fn parses_startup_parameters() {
        let p = parse_startup_body(packet(PROTOCOL_3_0, b"user\0alice\0database\0app\0\0"))
            .unwrap()
            .unwrap();
        let StartupPacket::Startup(params) = p else {
            panic!()
        };
        assert_eq!(StartupPacket::param(&params, "user"), Some("alice"));
        assert_eq!(StartupPacket::param(&params, "database"), Some("app"));
    }

    #[test]
    fn refuses_other_protocol_versions() {
        let e = parse_startup_body(packet(2 << 16, b"")).unwrap_err();
        assert_eq!(e.code, "0A000");
        assert!(e.message.contains("2.0"));
    }

    #[test]
    fn refuses_garbled_parameters() {
        for body in [&b"user\0alice"[..], b"user\0\0", b"user\0alice\0\0x\0"] {
            assert!(
                parse_startup_body(packet(PROTOCOL_3_0, body)).is_err(),
                "{body:?}"
            );
        }
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
            Some(StartupPacket::Cancel { pid: 7, secret: 9 })
        );
        assert_eq!(
            parse_startup_body(packet(SSL_REQUEST, b"")).unwrap(),
            Some(StartupPacket::SslRequest)
        );
    }
}
