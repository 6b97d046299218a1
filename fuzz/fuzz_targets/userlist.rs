//! `auth.file`: PgBouncer's userlist.txt, and the stored secrets in it
//! (md5 hashes, SCRAM-SHA-256 verifiers).
#![no_main]
use libfuzzer_sys::fuzz_target;
use usher::auth::userlist;
use usher::protocol::scram::ScramVerifier;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match userlist::entries(text) {
        Ok(entries) => {
            for (user, secret) in entries {
                assert!(!user.is_empty());
                // A verifier that parses has keys of the right size and
                // iterations > 0; plaintext secrets (a PBKDF2 run each to
                // load) are not looked at here.
                if let Some(v) = ScramVerifier::parse(&secret) {
                    assert!(v.iterations > 0);
                }
            }
        }
        Err(e) => assert!(e.to_string().starts_with("line "), "{e}"),
    }
});
