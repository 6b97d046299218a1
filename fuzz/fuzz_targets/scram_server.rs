//! The server side of SCRAM: client-first-message, then client-final-message.
//! `@@` in the final message stands for the nonce the server chose, so the
//! fuzzer gets past the nonce check to the proof.
#![no_main]
use libfuzzer_sys::fuzz_target;
use usher::protocol::scram::{ScramError, ScramServer, ScramVerifier};
use usher_fuzz::{splice, Input};

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let client_first = input.piece();
    let client_final = input.rest();
    let verifier = ScramVerifier {
        iterations: 4096,
        salt: b"salt".to_vec(),
        stored_key: [1; 32],
        server_key: [2; 32],
    };
    let Ok((server, server_first)) = ScramServer::start(verifier, client_first) else {
        return;
    };
    let nonce = server_first
        .strip_prefix("r=")
        .and_then(|r| r.split(',').next())
        .expect("server-first starts with the nonce");
    // The combined nonce extends the client's.
    let first = std::str::from_utf8(client_first).unwrap();
    let client_nonce = first
        .split(",r=")
        .nth(1)
        .unwrap()
        .split(',')
        .next()
        .unwrap();
    assert!(nonce.starts_with(client_nonce) && nonce.len() > client_nonce.len());
    let client_final = splice(client_final, b"@@", nonce.as_bytes());
    match server.finish(&client_final) {
        Ok(_) => panic!("a proof for keys no password has"),
        Err(ScramError::Malformed(_) | ScramError::WrongNonce | ScramError::WrongProof) => {}
    }
});
