//! Client authentication over an in-memory connection: the password
//! messages of password and md5, and SASLInitialResponse / SASLResponse of
//! SCRAM, against every kind of stored secret and an unknown user.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use usher::auth::{authenticate, AuthOutcome, Challenge, Secret};
use usher::config::AuthMethod;
use usher::protocol::scram::ScramVerifier;
use usher_fuzz::{block_on, Duplex, Input};

fn secrets() -> &'static [Secret; 3] {
    static SECRETS: OnceLock<[Secret; 3]> = OnceLock::new();
    SECRETS.get_or_init(|| {
        [
            Secret::parse("pw"),
            Secret::parse(&format!("md5{}", "0123456789abcdef".repeat(2))),
            // One PBKDF2 iteration: a cleartext password checked against it
            // costs nothing (the keys need not belong to any password).
            Secret::Scram(ScramVerifier {
                iterations: 1,
                salt: b"salt".to_vec(),
                stored_key: [1; 32],
                server_key: [2; 32],
            }),
        ]
    })
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let how = input.byte();
    let method = [
        AuthMethod::Password,
        AuthMethod::Md5,
        AuthMethod::ScramSha256,
    ][how as usize % 3];
    let secret = match (how / 3) % 4 {
        3 => None,
        i => Some(&secrets()[i as usize]),
    };
    let challenge = Challenge {
        method,
        user: "alice",
        known: secret.is_some(),
        secret,
        certificate: None,
        peer: None,
        mock_key: b"mock",
    };
    let mut stream = Duplex::new(input.rest());
    match block_on(authenticate(&mut stream, &challenge, || None)) {
        // The only password the fuzzer can know: "pw", sent in cleartext.
        Ok(_) => assert!(
            method == AuthMethod::Password && (how / 3) % 4 == 0,
            "authenticated without the password"
        ),
        Err(f) => {
            let code = f.error.code.as_str();
            match f.outcome {
                AuthOutcome::ProtocolError => assert_eq!(code, "08P01", "{}", f.error.message),
                AuthOutcome::WrongPassword | AuthOutcome::UnknownUser => {
                    assert_eq!(code, "28P01")
                }
                other => panic!("unexpected outcome {other:?}"),
            }
        }
    }
    // Nothing usher writes during login is larger than a few hundred bytes.
    assert!(stream.output.len() < 1024);
});
