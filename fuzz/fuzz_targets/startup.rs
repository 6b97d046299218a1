//! The client's first packet: length, code, and startup parameters.
#![no_main]
use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use usher::protocol::startup::{
    parse_startup_body, read_startup, StartupPacket, MAX_STARTUP_PACKET,
};
use usher_fuzz::block_on;

fuzz_target!(|data: &[u8]| {
    // From the socket: the length comes first and bounds the read.
    let mut reader = data;
    let result = block_on(read_startup(&mut reader));
    let consumed = data.len() - reader.len();
    assert!(consumed <= MAX_STARTUP_PACKET + 4, "read {consumed} bytes");
    check(result);
    // The body parser on its own, with any body.
    check(parse_startup_body(BytesMut::from(data)).map(Some));
});

fn check(result: Result<Option<StartupPacket>, usher::protocol::PgError>) {
    match result {
        Ok(Some(StartupPacket::Startup(message))) => {
            // A missing user is the login's to refuse (28000, as
            // PostgreSQL), not the parser's.
            let params = &message.params;
            for (k, v) in params {
                assert!(!k.is_empty() && !k.contains('\0') && !v.contains('\0'));
            }
        }
        Ok(_) => {}
        Err(e) => assert!(
            matches!(e.code.as_str(), "08P01" | "0A000" | "28000" | "22023"),
            "unexpected SQLSTATE {} ({})",
            e.code,
            e.message
        ),
    }
}
