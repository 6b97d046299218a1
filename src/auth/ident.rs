//! User name maps, as PostgreSQL's pg_ident.conf: which operating-system
//! user may log in as which database user under `peer` authentication.
//! An HBA rule names its map (`map=name`); without one the two names must
//! be equal.
//!
//! The maps come from `auth.ident` (a YAML list with the columns as keys)
//! or `auth.ident_file` (pg_ident.conf's own format: `map system-user
//! database-user` per line, `#` comments, `"quoted"` names). As in
//! PostgreSQL, a system user that begins with `/` (unquoted in the file)
//! is a regular expression, matched anywhere unless anchored, and `\1` in
//! the database user stands for its first parenthesised group; a database
//! user `all` (unquoted) is any user. The expressions are Rust's `regex`
//! syntax, which reads PostgreSQL's usual patterns (`^(.*)@example\.com$`)
//! the same way.

use super::hba::{fields, Token};
use crate::config::{ConfigIssue, IdentEntryConfig};
use regex::Regex;

/// What is wrong with an entry of a map.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentError {
    #[error("expected three fields (map, system user, database user), got {0}")]
    Fields(usize),
    #[error("expected one {0}, not a list")]
    ExpectedOne(&'static str),
    #[error("empty {0}")]
    Empty(&'static str),
    #[error("invalid regular expression `{pattern}`: {error}")]
    Regex { pattern: String, error: String },
    #[error("`{0}`: \\1 needs a system user that is a regular expression with a group")]
    NoGroup(String),
    #[error("`{0}` is not supported (group membership and expressions of database users)")]
    Unsupported(String),
    #[error("unterminated quoted string")]
    UnterminatedQuote,
}

/// A line of a pg_ident.conf-format file that is not an entry usher can use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {error}")]
pub struct IdentFileError {
    pub line: usize,
    pub error: IdentError,
}

/// Every map's entries, in order.
#[derive(Debug, Clone, Default)]
pub struct IdentMap {
    entries: Vec<Entry>,
}

#[derive(Debug, Clone)]
struct Entry {
    map: String,
    system: SystemUser,
    user: DatabaseUser,
}

#[derive(Debug, Clone)]
enum SystemUser {
    Name(String),
    Pattern(Regex),
}

#[derive(Debug, Clone)]
enum DatabaseUser {
    /// `all`: any database user.
    All,
    /// A name; with `\1`, the place of the system user's first group.
    Name(String),
}

impl IdentMap {
    /// Compiles `auth.ident`; an error names the key.
    pub fn from_config(entries: &[IdentEntryConfig]) -> Result<IdentMap, ConfigIssue> {
        let mut out = Vec::with_capacity(entries.len());
        for (i, e) in entries.iter().enumerate() {
            let at = |field: &str| {
                let key = format!("auth.ident[{i}].{field}");
                move |e: IdentError| ConfigIssue::new(key, e.to_string())
            };
            let token = |text: &str| Token {
                text: text.to_string(),
                quoted: false,
            };
            if e.map.is_empty() {
                return Err(at("map")(IdentError::Empty("map name")));
            }
            let system = system_user(&token(&e.system_user)).map_err(at("system_user"))?;
            let user = database_user(&token(&e.user), &system).map_err(at("user"))?;
            out.push(Entry {
                map: e.map.clone(),
                system,
                user,
            });
        }
        Ok(IdentMap { entries: out })
    }

    /// Parses a pg_ident.conf-format file; errors say the line.
    pub fn parse_file(text: &str) -> Result<IdentMap, IdentFileError> {
        let mut entries = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let bad = |error: IdentError| IdentFileError { line: i + 1, error };
            let fields = fields(line).map_err(|_| bad(IdentError::UnterminatedQuote))?;
            if fields.is_empty() {
                continue;
            }
            if fields.len() != 3 {
                return Err(bad(IdentError::Fields(fields.len())));
            }
            let one = |f: &Vec<Token>, what: &'static str| match f.as_slice() {
                [t] if t.text.is_empty() => Err(bad(IdentError::Empty(what))),
                [t] => Ok(t.clone()),
                _ => Err(bad(IdentError::ExpectedOne(what))),
            };
            let map = one(&fields[0], "map name")?.text;
            let system = system_user(&one(&fields[1], "system user")?).map_err(bad)?;
            let user = database_user(&one(&fields[2], "database user")?, &system).map_err(bad)?;
            entries.push(Entry { map, system, user });
        }
        Ok(IdentMap { entries })
    }

    /// True if some entry has this map name.
    pub fn has_map(&self, map: &str) -> bool {
        self.entries.iter().any(|e| e.map == map)
    }

    /// Whether `map` lets the operating-system user `system` log in as the
    /// database user `user` (PostgreSQL's check_usermap; names compare
    /// case-sensitively, as for `peer`).
    pub fn permits(&self, map: &str, system: &str, user: &str) -> bool {
        self.entries
            .iter()
            .filter(|e| e.map == map)
            .any(|e| match (&e.system, &e.user) {
                (SystemUser::Name(n), DatabaseUser::All) => n == system,
                (SystemUser::Name(n), DatabaseUser::Name(u)) => n == system && u == user,
                (SystemUser::Pattern(re), target) => {
                    let Some(caps) = re.captures(system) else {
                        return false;
                    };
                    match target {
                        DatabaseUser::All => true,
                        // As PostgreSQL: the first `\1` only.
                        DatabaseUser::Name(u) => match caps.get(1) {
                            Some(group) if u.contains("\\1") => {
                                u.replacen("\\1", group.as_str(), 1) == user
                            }
                            _ => u == user,
                        },
                    }
                }
            })
    }
}

fn system_user(t: &Token) -> Result<SystemUser, IdentError> {
    match t.text.strip_prefix('/') {
        Some(pattern) if !t.quoted => {
            Regex::new(pattern)
                .map(SystemUser::Pattern)
                .map_err(|e| IdentError::Regex {
                    pattern: pattern.to_string(),
                    error: e.to_string(),
                })
        }
        _ if t.text.is_empty() => Err(IdentError::Empty("system user")),
        _ => Ok(SystemUser::Name(t.text.clone())),
    }
}

fn database_user(t: &Token, system: &SystemUser) -> Result<DatabaseUser, IdentError> {
    let text = t.text.as_str();
    if text.is_empty() {
        return Err(IdentError::Empty("database user"));
    }
    if !t.quoted {
        if text == "all" {
            return Ok(DatabaseUser::All);
        }
        if text.starts_with('+') || text.starts_with('/') {
            return Err(IdentError::Unsupported(text.to_string()));
        }
    }
    if text.contains("\\1") {
        let has_group = matches!(system, SystemUser::Pattern(re) if re.captures_len() > 1);
        if !has_group {
            return Err(IdentError::NoGroup(text.to_string()));
        }
    }
    Ok(DatabaseUser::Name(text.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_patterns_groups_and_all_as_postgres() {
        let map = IdentMap::parse_file(
            "# MAPNAME  SYSTEM-USERNAME      PG-USERNAME\n\
             local      root                 alice\n\
             local      root                 \"bob\"   # a comment\n\
             local      /^app_(.*)$          \\1_rw\n\
             local      /^svc-               reporting\n\
             ops        deploy               all\n\
             other      carol                carol\n",
        )
        .unwrap();
        assert!(map.permits("local", "root", "alice"));
        assert!(map.permits("local", "root", "bob"));
        assert!(!map.permits("local", "root", "carol"));
        assert!(map.permits("local", "app_billing", "billing_rw"));
        assert!(!map.permits("local", "app_billing", "billing"));
        assert!(
            map.permits("local", "svc-metrics", "reporting"),
            "an unanchored expression matches anywhere"
        );
        assert!(!map.permits("local", "my-svc-metrics", "alice"));
        assert!(map.permits("ops", "deploy", "anyone"));
        assert!(!map.permits("ops", "root", "anyone"));
        assert!(
            !map.permits("local", "carol", "carol"),
            "only the map named"
        );
        assert!(!map.permits("nosuch", "root", "alice"));
        assert!(map.has_map("ops") && !map.has_map("nosuch"));
    }

    #[test]
    fn only_the_first_backreference_is_replaced_and_quoted_names_are_names() {
        let map = IdentMap::parse_file("m /^(.*)$ \\1_\\1\nm \"/etc\" \"all\"\n").unwrap();
        assert!(map.permits("m", "x", "x_\\1"));
        assert!(!map.permits("m", "x", "x_x"));
        assert!(
            map.permits("m", "/etc", "all"),
            "quoted: a literal name and user"
        );
        assert!(!map.permits("m", "/etc", "alice"));
    }

    #[test]
    fn errors_say_the_line() {
        for (text, expected) in [
            ("m root\n", "line 1: expected three fields"),
            ("\nm root alice extra\n", "line 2: expected three fields"),
            ("m /( alice\n", "line 1: invalid regular expression"),
            ("m root \\1\n", "line 1: `\\1`: \\1 needs"),
            ("m /^root$ \\1\n", "line 1: `\\1`: \\1 needs"),
            ("m root +admins\n", "line 1: `+admins` is not supported"),
            ("m root,toor alice\n", "line 1: expected one system user"),
            ("m \"root alice\n", "line 1: unterminated"),
        ] {
            let e = IdentMap::parse_file(text).unwrap_err().to_string();
            assert!(e.starts_with(expected), "{text:?}: {e}");
        }
    }

    #[test]
    fn the_yaml_form_reads_the_same_and_names_the_key() {
        let entries: Vec<IdentEntryConfig> = serde_yaml::from_str(
            "- { map: local, system_user: root, user: alice }\n\
             - { map: local, system_user: '/^(.*)_adm$', user: '\\1' }\n",
        )
        .unwrap();
        let map = IdentMap::from_config(&entries).unwrap();
        assert!(map.permits("local", "root", "alice"));
        assert!(map.permits("local", "dana_adm", "dana"));
        let entries: Vec<IdentEntryConfig> =
            serde_yaml::from_str("- { map: local, system_user: '/(', user: alice }\n").unwrap();
        let issue = IdentMap::from_config(&entries).unwrap_err();
        assert_eq!(issue.key, "auth.ident[0].system_user");
    }
}
