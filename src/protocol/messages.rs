//! Backend messages usher writes itself, and reading whole messages during
//! login (where they are small and usher must look inside them).

use super::error::PgError;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};

/// Messages usher reads whole before the session starts are never larger than this.
pub const MAX_LOGIN_MESSAGE: usize = 16 * 1024;

/// Starts a message with `tag`; returns the position to pass to [`finish`].
fn begin(buf: &mut BytesMut, tag: u8) -> usize {
    let start = buf.len();
    buf.put_u8(tag);
    buf.put_u32(0);
    start
}

/// Writes the length of the message started at `start`.
fn finish(buf: &mut BytesMut, start: usize) {
    let len = (buf.len() - start - 1) as u32;
    buf[start + 1..start + 5].copy_from_slice(&len.to_be_bytes());
}

fn put_cstr(buf: &mut BytesMut, s: &str) {
    buf.put_slice(s.as_bytes());
    buf.put_u8(0);
}

pub fn authentication_ok(buf: &mut BytesMut) {
    let s = begin(buf, b'R');
    buf.put_u32(0);
    finish(buf, s);
}

pub fn authentication_cleartext(buf: &mut BytesMut) {
    let s = begin(buf, b'R');
    buf.put_u32(3);
    finish(buf, s);
}

pub fn authentication_md5(buf: &mut BytesMut, salt: [u8; 4]) {
    let s = begin(buf, b'R');
    buf.put_u32(5);
    buf.put_slice(&salt);
    finish(buf, s);
}

pub fn authentication_sasl(buf: &mut BytesMut, mechanisms: &[&str]) {
    let s = begin(buf, b'R');
    buf.put_u32(10);
    for m in mechanisms {
        put_cstr(buf, m);
    }
    buf.put_u8(0);
    finish(buf, s);
}

pub fn authentication_sasl_continue(buf: &mut BytesMut, data: &[u8]) {
    let s = begin(buf, b'R');
    buf.put_u32(11);
    buf.put_slice(data);
    finish(buf, s);
}

pub fn authentication_sasl_final(buf: &mut BytesMut, data: &[u8]) {
    let s = begin(buf, b'R');
    buf.put_u32(12);
    buf.put_slice(data);
    finish(buf, s);
}

/// NegotiateProtocolVersion ('v'): the newest version usher speaks (3.0, as
/// PostgreSQL 15 sends it: the whole version number) and the `_pq_.`
/// options it did not recognize.
pub fn negotiate_protocol_version(buf: &mut BytesMut, options: &[String]) {
    let s = begin(buf, b'v');
    buf.put_u32(super::startup::PROTOCOL_3_0);
    buf.put_u32(options.len() as u32);
    for o in options {
        put_cstr(buf, o);
    }
    finish(buf, s);
}

pub fn parameter_status(buf: &mut BytesMut, name: &str, value: &str) {
    let s = begin(buf, b'S');
    put_cstr(buf, name);
    put_cstr(buf, value);
    finish(buf, s);
}

pub fn backend_key_data(buf: &mut BytesMut, pid: u32, secret: u32) {
    let s = begin(buf, b'K');
    buf.put_u32(pid);
    buf.put_u32(secret);
    finish(buf, s);
}

pub fn ready_for_query(buf: &mut BytesMut, status: u8) {
    let s = begin(buf, b'Z');
    buf.put_u8(status);
    finish(buf, s);
}

/// RowDescription for text columns.
pub fn row_description(buf: &mut BytesMut, columns: &[&str]) {
    let s = begin(buf, b'T');
    buf.put_u16(columns.len() as u16);
    for c in columns {
        put_cstr(buf, c);
        buf.put_u32(0); // table oid
        buf.put_u16(0); // column number
        buf.put_u32(25); // type: text
        buf.put_i16(-1); // type size
        buf.put_i32(-1); // type modifier
        buf.put_u16(0); // text format
    }
    finish(buf, s);
}

/// DataRow; `None` is SQL NULL.
pub fn data_row(buf: &mut BytesMut, values: &[Option<&str>]) {
    let s = begin(buf, b'D');
    buf.put_u16(values.len() as u16);
    for v in values {
        match v {
            Some(v) => {
                buf.put_u32(v.len() as u32);
                buf.put_slice(v.as_bytes());
            }
            None => buf.put_i32(-1),
        }
    }
    finish(buf, s);
}

pub fn command_complete(buf: &mut BytesMut, tag: &str) {
    let s = begin(buf, b'C');
    put_cstr(buf, tag);
    finish(buf, s);
}

pub fn empty_query_response(buf: &mut BytesMut) {
    let s = begin(buf, b'I');
    finish(buf, s);
}

/// A message with an empty body (ParseComplete, BindComplete,
/// CloseComplete, NoData): `tag` is one of `tags::backend`'s.
pub fn empty_message(buf: &mut BytesMut, tag: u8) {
    let s = begin(buf, tag);
    finish(buf, s);
}

/// ParameterDescription of a statement without parameters.
pub fn no_parameters(buf: &mut BytesMut) {
    let s = begin(buf, b't');
    buf.put_u16(0);
    finish(buf, s);
}

/// A whole message: its type byte and its body (without the length).
#[derive(Debug, Clone)]
pub struct Message {
    pub tag: u8,
    pub body: Bytes,
}

/// Reads one whole message of at most `max` bytes. `Ok(None)` on a clean EOF
/// before the first byte.
pub async fn read_message<R: AsyncRead + Unpin>(
    reader: &mut R,
    max: usize,
) -> Result<Option<Message>, PgError> {
    let mut header = [0u8; 5];
    match reader.read_exact(&mut header[..1]).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(PgError::protocol(format!("could not read message: {e}"))),
    }
    reader
        .read_exact(&mut header[1..])
        .await
        .map_err(|_| PgError::protocol("unexpected end of message"))?;
    let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
    if len < 4 || len > max {
        return Err(PgError::protocol(format!(
            "invalid message length {len} for message type '{}'",
            printable(header[0])
        )));
    }
    let mut body = BytesMut::zeroed(len - 4);
    reader
        .read_exact(&mut body)
        .await
        .map_err(|_| PgError::protocol("unexpected end of message"))?;
    Ok(Some(Message {
        tag: header[0],
        body: body.freeze(),
    }))
}

/// The message type as a character for error messages.
pub fn printable(tag: u8) -> char {
    if tag.is_ascii_graphic() {
        tag as char
    } else {
        '?'
    }
}

/// Reads a NUL-terminated string from the front of `body`.
pub fn get_cstr(body: &mut Bytes) -> Result<String, PgError> {
    let end = body
        .iter()
        .position(|b| *b == 0)
        .ok_or_else(|| PgError::protocol("string in message is not terminated"))?;
    let s = String::from_utf8(body[..end].to_vec())
        .map_err(|_| PgError::protocol("string in message is not UTF-8"))?;
    body.advance(end + 1);
    Ok(s)
}

/// Reads the body of a ParameterStatus message.
pub fn parse_parameter_status(body: &[u8]) -> Option<(String, String)> {
    let mut b = Bytes::copy_from_slice(body);
    let name = get_cstr(&mut b).ok()?;
    let value = get_cstr(&mut b).ok()?;
    Some((name, value))
}

/// The SQLSTATE (field `C`) of an ErrorResponse or NoticeResponse body,
/// without copying. `None` if the body has no `C` field or is cut short.
pub fn error_code(body: &[u8]) -> Option<&[u8]> {
    error_field(body, b'C')
}

/// The message (field `M`) of an ErrorResponse or NoticeResponse body,
/// without copying.
pub fn error_message(body: &[u8]) -> Option<&[u8]> {
    error_field(body, b'M')
}

/// True for the body of a FATAL or PANIC ErrorResponse: the server closes
/// the connection after it.
pub fn error_is_fatal(body: &[u8]) -> bool {
    // `V` is never localized (protocol 3.0, PostgreSQL 9.6+); `S` may be.
    let severity = error_field(body, b'V').or_else(|| error_field(body, b'S'));
    matches!(severity, Some(b"FATAL" | b"PANIC"))
}

/// One field of an ErrorResponse or NoticeResponse body, without copying:
/// fields are a type byte and a C string each, ended by a zero byte.
/// An ErrorResponse or NoticeResponse body with field `field` set to
/// `value` in place (its other fields unchanged, in order); `None` if the
/// body has no such field or is malformed.
pub fn with_error_field(body: &[u8], field: u8, value: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(body.len() + value.len());
    let mut rest = body;
    let mut replaced = false;
    while let Some((&kind, after)) = rest.split_first() {
        if kind == 0 {
            out.push(0);
            return replaced.then_some(out);
        }
        let end = after.iter().position(|b| *b == 0)?;
        out.push(kind);
        if kind == field {
            out.extend_from_slice(value);
            replaced = true;
        } else {
            out.extend_from_slice(&after[..end]);
        }
        out.push(0);
        rest = &after[end + 1..];
    }
    None
}

/// An ErrorResponse body as a [`PgError`] (code, message, detail, hint;
/// ERROR severity: the caller says what it is to the client); `None`
/// without a code and a message.
pub fn error_from_body(body: &[u8]) -> Option<PgError> {
    let text = |f| error_field(body, f).map(|v| String::from_utf8_lossy(v).into_owned());
    let code = text(b'C')?;
    let mut e = PgError::error(&code, text(b'M')?);
    e.detail = text(b'D');
    e.hint = text(b'H');
    Some(e)
}

/// Field `field` of an ErrorResponse or NoticeResponse body.
pub fn error_field_of(body: &[u8], field: u8) -> Option<&[u8]> {
    error_field(body, field)
}

fn error_field(body: &[u8], field: u8) -> Option<&[u8]> {
    let mut rest = body;
    while let Some((&kind, after)) = rest.split_first() {
        if kind == 0 {
            return None;
        }
        let end = after.iter().position(|b| *b == 0)?;
        if kind == field {
            return Some(&after[..end]);
        }
        rest = &after[end + 1..];
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_sqlstate_of_an_error() {
        let mut buf = BytesMut::new();
        crate::protocol::PgError::error("42P01", "relation \"x\" does not exist")
            .with_detail("d")
            .encode(&mut buf);
        assert_eq!(error_code(&buf[5..]), Some(&b"42P01"[..]));
        assert_eq!(error_code(b"SERROR\0VERROR\0Mno code\0\0"), None);
        assert_eq!(error_code(b"SERROR\0C4260"), None);
        assert_eq!(error_code(b""), None);
        assert!(!error_is_fatal(&buf[5..]));
        assert!(error_is_fatal(b"SFATAL\0VFATAL\0C57P01\0Mbye\0\0"));
        assert!(error_is_fatal(b"SPANIK\0VPANIC\0\0"));
        assert!(error_is_fatal(b"SFATAL\0C57P01\0\0"));
        assert!(!error_is_fatal(b"SFATAL\0VERROR\0\0"));
    }

    #[test]
    fn writes_negotiate_protocol_version() {
        let mut buf = BytesMut::new();
        negotiate_protocol_version(&mut buf, &["_pq_.a".into(), "_pq_.b".into()]);
        assert_eq!(&buf[..], b"v\0\0\0\x1a\0\x03\0\0\0\0\0\x02_pq_.a\0_pq_.b\0");
    }

    #[tokio::test]
    async fn round_trips_a_message() {
        let mut buf = BytesMut::new();
        parameter_status(&mut buf, "TimeZone", "UTC");
        let mut r = &buf[..];
        let m = read_message(&mut r, 100).await.unwrap().unwrap();
        assert_eq!(m.tag, b'S');
        assert_eq!(
            parse_parameter_status(&m.body),
            Some(("TimeZone".into(), "UTC".into()))
        );
    }

    #[tokio::test]
    async fn refuses_oversized_message() {
        let mut buf = BytesMut::new();
        buf.put_u8(b'p');
        buf.put_u32(1_000_000);
        let mut r = &buf[..];
        let e = read_message(&mut r, 1000).await.unwrap_err();
        assert_eq!(e.code, "08P01");
    }
}
