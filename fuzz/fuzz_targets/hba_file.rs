//! pg_hba.conf-format rules (`auth.hba_file`), then a decision for a few
//! connections when they parse.
#![no_main]
use libfuzzer_sys::fuzz_target;
use usher::auth::hba::{Connection, Decision, Hba};
use usher::client_addr::ClientHost;
use usher_fuzz::block_on;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match Hba::parse_file(text, "f") {
        Ok(hba) => decide_some(&hba, "f:"),
        Err(e) => assert!(e.to_string().starts_with("line "), "{e}"),
    }
});

/// Decides for connections over both address families and the Unix-domain
/// socket, with and without TLS; every decision names a rule of this file.
fn decide_some(hba: &Hba, origin: &str) {
    for (addr, tls) in [
        ("127.0.0.1", false),
        ("10.1.2.3", true),
        ("::1", false),
        ("::ffff:10.1.2.3", true),
        ("2001:db8::1", false),
        ("local", false),
    ] {
        let host = match addr {
            "local" => ClientHost::Local,
            ip => ClientHost::Ip(ip.parse().unwrap()),
        };
        let conn = Connection {
            host,
            tls,
            database: "app",
            user: "alice",
        };
        let decision = block_on(hba.decide(&conn, |role| async move { role.len() % 2 == 0 }));
        match decision {
            Decision::Method { rule, .. } | Decision::Reject { rule } => {
                assert!(rule.starts_with(origin), "{rule}")
            }
            Decision::NoMatch => {}
        }
    }
}
