//! The client side of SCRAM from keys (pass-through to PostgreSQL): the
//! server-first-message, then the server-final-message. `@@` stands for the
//! nonce usher chose and `$$` for the salt usher knows, so the fuzzer gets
//! past those checks.
#![no_main]
use libfuzzer_sys::fuzz_target;
use usher::protocol::scram::ScramVerifier;
use usher::protocol::scram_client::{ScramClient, ScramKeys};
use usher_fuzz::{splice, Input};

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let server_first = input.piece();
    let server_final = input.rest();
    let keys = ScramKeys {
        client_key: [3; 32],
        verifier: ScramVerifier {
            iterations: 4096,
            salt: b"salt".to_vec(),
            stored_key: [1; 32],
            server_key: [2; 32],
        },
    };
    let mut client = ScramClient::new(keys);
    let first = std::str::from_utf8(client.message()).expect("UTF-8");
    let nonce = first
        .strip_prefix("n,,n=,r=")
        .expect("client-first")
        .to_string();
    let server_first = splice(server_first, b"@@", nonce.as_bytes());
    let server_first = splice(&server_first, b"$$", b"c2FsdA==");
    if client.update(&server_first).is_ok() {
        let fin = std::str::from_utf8(client.message()).expect("UTF-8");
        assert!(fin.starts_with("c=biws,r=") && fin.contains(",p="));
        // Without the ServerKey no signature can be right.
        assert!(client.finish(server_final).is_err());
    } else {
        assert!(client.finish(server_final).is_err(), "final before first");
    }
});
