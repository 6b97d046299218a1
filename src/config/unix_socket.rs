//! The keys of the clients' Unix-domain socket: `unix_socket_dir`,
//! `unix_socket_mode` and `unix_socket_group`, with PgBouncer's meanings.
//! The socket itself is made in [`crate::unix_listen`].

use super::{Config, ConfigIssue};
use serde::{Deserialize, Deserializer};
use std::fmt;
use std::os::unix::ffi::OsStrExt;

/// The longest `unix_socket_dir`, in bytes: the socket's temporary name
/// (`/.s.PGSQL.<port>.<pid>`, at most 23 bytes) must fit the 107 bytes of
/// a Unix socket address's path.
pub const MAX_DIR_BYTES: usize = 107 - "/.s.PGSQL.65535.4194304".len();

/// A socket file's permission bits, written in octal with a leading 0 as
/// chmod and PgBouncer's `unix_socket_mode` take them (`0777`, `0660`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct SocketMode(pub u32);

impl fmt::Debug for SocketMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04o}", self.0)
    }
}

impl fmt::Display for SocketMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04o}", self.0)
    }
}

const EXPECTED_MODE: &str =
    "expected permission bits in octal with a leading 0, such as 0777 or 0660";

impl SocketMode {
    /// Reads `0777`-style text.
    pub fn parse(text: &str) -> Result<SocketMode, String> {
        let digits = text
            .strip_prefix('0')
            .filter(|d| {
                !d.is_empty() && d.len() <= 4 && d.bytes().all(|b| (b'0'..=b'7').contains(&b))
            })
            .ok_or_else(|| format!("{EXPECTED_MODE}, got `{text}`"))?;
        let mode = u32::from_str_radix(digits, 8).map_err(|e| e.to_string())?;
        if mode > 0o777 {
            return Err(format!("{EXPECTED_MODE} (at most 0777), got `{text}`"));
        }
        Ok(SocketMode(mode))
    }
}

/// YAML reads `0660` as the string "0660" (a leading zero is not a YAML
/// 1.2 number); `0o660` and `660` are numbers, which cannot be told apart
/// from decimal ones, and are refused.
impl<'de> Deserialize<'de> for SocketMode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let value = serde_yaml::Value::deserialize(d)?;
        match value {
            serde_yaml::Value::String(text) => {
                SocketMode::parse(&text).map_err(serde::de::Error::custom)
            }
            _ => Err(serde::de::Error::custom(format!(
                "{EXPECTED_MODE} (unquoted 0o777 or 777 are read as numbers)"
            ))),
        }
    }
}

/// Checks the socket's keys.
pub(super) fn validate(config: &Config) -> Result<(), ConfigIssue> {
    let Some(dir) = &config.unix_socket_dir else {
        if config.unix_socket_group.is_some() {
            return Err(ConfigIssue::new(
                "unix_socket_group",
                "is for the Unix socket, which is off: set unix_socket_dir too",
            ));
        }
        return Ok(());
    };
    let key = "unix_socket_dir";
    if !dir.is_absolute() {
        return Err(ConfigIssue::new(
            key,
            format!("expected an absolute directory, got `{}`", dir.display()),
        ));
    }
    let bytes = dir.as_os_str().as_bytes();
    if bytes.len() > MAX_DIR_BYTES {
        return Err(ConfigIssue::new(
            key,
            format!(
                "expected a directory path of at most {MAX_DIR_BYTES} bytes (got {}): the socket's path must fit the 107 bytes of a Unix socket address",
                bytes.len()
            ),
        ));
    }
    if config
        .unix_socket_group
        .as_ref()
        .is_some_and(|g| g.trim().is_empty())
    {
        return Err(ConfigIssue::new(
            "unix_socket_group",
            "expected a group name or number",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(yaml: &str) -> (String, String) {
        let e = Config::from_yaml(yaml, "u.yaml").unwrap_err();
        (e.key, e.message)
    }

    #[test]
    fn modes_are_octal_text_with_a_leading_zero() {
        assert_eq!(SocketMode::parse("0777"), Ok(SocketMode(0o777)));
        assert_eq!(SocketMode::parse("0660"), Ok(SocketMode(0o660)));
        assert_eq!(SocketMode::parse("00"), Ok(SocketMode(0)));
        for bad in ["777", "0", "0778", "01777", "0x1ff", "", "0 777"] {
            assert!(SocketMode::parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(SocketMode(0o660).to_string(), "0660");
        let c =
            Config::from_yaml("unix_socket_dir: /tmp\nunix_socket_mode: 0660\n", "u.yaml").unwrap();
        assert_eq!(c.unix_socket_mode, SocketMode(0o660));
        let c = Config::from_yaml("{}\n", "u.yaml").unwrap();
        assert_eq!(c.unix_socket_mode, SocketMode(0o777));
        assert_eq!(c.unix_socket_dir, None, "off unless set");
        for number in ["0o660", "660", "432"] {
            let (key, message) = err(&format!("unix_socket_mode: {number}\n"));
            assert_eq!(key, "unix_socket_mode");
            assert!(message.contains("leading 0"), "{message}");
        }
    }

    #[test]
    fn the_directory_is_absolute_and_short_enough() {
        assert_eq!(err("unix_socket_dir: run\n").0, "unix_socket_dir");
        let long = format!("/{}", "d".repeat(MAX_DIR_BYTES));
        let (key, message) = err(&format!("unix_socket_dir: {long}\n"));
        assert_eq!(key, "unix_socket_dir");
        assert!(message.contains("107 bytes"), "{message}");
        let fits = format!("/{}", "d".repeat(MAX_DIR_BYTES - 1));
        Config::from_yaml(&format!("unix_socket_dir: {fits}\n"), "u.yaml").unwrap();
        assert_eq!(err("unix_socket_group: usher\n").0, "unix_socket_group");
        assert_eq!(
            err("unix_socket_dir: /tmp\nunix_socket_group: ''\n").0,
            "unix_socket_group"
        );
    }
}
