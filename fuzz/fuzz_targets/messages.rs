//! Whole messages read during login and by the console (read_message), and
//! the body readers: ParameterStatus, the SQLSTATE of an ErrorResponse,
//! NUL-terminated strings.
#![no_main]
use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use usher::protocol::messages::{
    error_code, get_cstr, parse_parameter_status, read_message, MAX_LOGIN_MESSAGE,
};
use usher_fuzz::{block_on, Input};

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let max = [5, 64, MAX_LOGIN_MESSAGE, 64 * 1024][input.byte() as usize % 4];
    let mut reader = input.rest();
    let mut messages = 0;
    loop {
        let left = reader.len();
        match block_on(read_message(&mut reader, max)) {
            Ok(Some(m)) => {
                assert!(m.body.len() + 4 <= max, "a body over the limit");
                assert_eq!(left - reader.len(), 5 + m.body.len());
                bodies(&m.body);
                messages += 1;
            }
            Ok(None) => {
                assert_eq!(left, 0, "end of stream only at a message boundary");
                break;
            }
            Err(e) => {
                assert_eq!(e.code, "08P01");
                break;
            }
        }
    }
    // Any bytes as a body, too.
    let _ = messages;
    bodies(data);
});

fn bodies(body: &[u8]) {
    if let Some((name, value)) = parse_parameter_status(body) {
        assert!(!name.contains('\0') && !value.contains('\0'));
        assert!(name.len() + value.len() + 2 <= body.len());
    }
    if let Some(code) = error_code(body) {
        assert!(!code.contains(&0));
        assert!(code.len() < body.len());
    }
    let mut b = Bytes::copy_from_slice(body);
    let mut seen = 0;
    while let Ok(s) = get_cstr(&mut b) {
        seen += s.len() + 1;
        assert_eq!(seen + b.len(), body.len());
    }
}
