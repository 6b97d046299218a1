//! `auth.hba` rules (a YAML list with pg_hba.conf's columns as keys), then a
//! decision for a few connections when they compile.
#![no_main]
use libfuzzer_sys::fuzz_target;
use usher::auth::hba::{Connection, Decision, Hba};
use usher::client_addr::ClientHost;
use usher::config::HbaRuleConfig;
use usher_fuzz::block_on;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(rules) = serde_yaml::from_str::<Vec<HbaRuleConfig>>(text) else {
        return;
    };
    match Hba::from_config(&rules) {
        Ok(hba) => {
            let hosts = [
                (ClientHost::Ip("127.0.0.1".parse().unwrap()), false),
                (ClientHost::Ip("10.1.2.3".parse().unwrap()), true),
                (ClientHost::Ip("::1".parse().unwrap()), false),
                (ClientHost::Local, false),
            ];
            for (host, tls) in hosts {
                let conn = Connection {
                    host,
                    tls,
                    database: "app",
                    user: "alice",
                };
                match block_on(hba.decide(&conn, |role| async move { role.len() % 2 == 0 })) {
                    Decision::Method { rule, .. } | Decision::Reject { rule } => {
                        assert!(rule.starts_with("auth.hba["), "{rule}")
                    }
                    Decision::NoMatch => {}
                }
            }
        }
        Err(issue) => assert!(issue.key.starts_with("auth.hba["), "{issue}"),
    }
});
