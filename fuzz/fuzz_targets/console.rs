//! The admin console's command parser, on the text of a simple Query as the
//! console reads it.
#![no_main]
use libfuzzer_sys::fuzz_target;
use usher::admin::{parse_command, AuthMonTarget, Command};

fuzz_target!(|data: &[u8]| {
    let sql = String::from_utf8_lossy(data);
    let sql = sql.trim_end_matches('\0');
    match parse_command(sql) {
        Ok(Command::Show(what)) => {
            assert!(!what.is_empty() && !what.contains(char::is_whitespace));
            assert_eq!(what, what.to_ascii_uppercase());
        }
        Ok(
            Command::Pause(Some(name))
            | Command::Resume(Some(name))
            | Command::Reconnect(Some(name))
            | Command::Kill(Some(name))
            | Command::MaintenanceOn(name)
            | Command::ResetAuthMon(Some(AuthMonTarget::Role(name))),
        ) => {
            // A name is taken from the command as written.
            let unquoted = name.replace('"', "");
            assert!(
                sql.replace('"', "").contains(&unquoted),
                "{name:?} is not in {sql:?}"
            );
        }
        Ok(Command::Empty) => assert!(sql.trim().trim_end_matches(';').trim().is_empty()),
        Ok(_) => {}
        Err(e) => {
            assert_eq!(e.code, "42601");
            assert!(!e.message.is_empty());
        }
    }
});
