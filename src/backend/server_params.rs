//! A server connection's parameters, in one place: what the server
//! reported at login (its base), what they are now, and the settings that
//! bring the connection in line with what a session wants (as PgBouncer's
//! varcache_apply does).
//!
//! The base is the truth about this connection's defaults: the server's
//! configuration, ALTER ROLE / ALTER DATABASE ... SET for usher's user and
//! database, as a fresh backend has them. usher's startup packet carries
//! nothing else, so the base is also what RESET returns to on this
//! connection. A session's wanted parameters are applied from the base:
//! a parameter another session changed goes back to it first, because a
//! value may be read against the one in place (`DateStyle = iso` keeps the
//! field order the session has).

use super::{QueryError, ServerConn};
use std::collections::HashMap;

/// Parameters the server sets and no session may: never set, never reset
/// (a SET of `is_superuser`, which SET ROLE changes, would be FATAL 55P02).
pub const SERVER_SET: &[&str] = &[
    "is_superuser",
    "server_version",
    "server_version_num",
    "server_encoding",
    "integer_datetimes",
    "in_hot_standby",
];

/// The session's identity: set after every other setting (setting it
/// resets `role`, which comes last), and reset before them, so that a
/// setting only a superuser may make (session_replication_role) is made
/// as the login's own user, as the client made it before it changed
/// identity.
const SESSION_AUTHORIZATION: &str = "session_authorization";
const ROLE: &str = "role";

fn is_identity(name: &str) -> bool {
    name == SESSION_AUTHORIZATION || name == ROLE
}

/// Parameters whose values are lists of names that SET quotes (GUC_LIST_QUOTE):
/// `SET search_path TO 'a,b'` is one schema named `a,b`, so a value given
/// as a startup packet gives it goes back through set_config(), never SET.
const LIST_QUOTED: &[&str] = &[
    "search_path",
    "temp_tablespaces",
    "session_preload_libraries",
    "local_preload_libraries",
];

/// What a server connection's parameters were brought in line with: a
/// digest of a session's wanted parameters (frontend::params computes it),
/// so sessions that want the same share it. A collision-resistant digest:
/// equal means equal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamsFingerprint(pub [u8; 16]);

/// One session setting to apply to a server connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setting {
    pub name: String,
    /// `None`: back to this connection's base (RESET).
    pub value: Option<String>,
}

/// What a session wants on its server connection.
#[derive(Debug, Clone, Copy)]
pub struct Wanted<'a> {
    /// Every parameter it wants: canonical names, values as a startup
    /// packet gives them.
    pub params: &'a [(String, String)],
    /// Those of them the client set itself (SET, set_config()): set on the
    /// server even where its default has the same value, so that when the
    /// session reads its settings back a value it set (listed: set in the
    /// session) is told from one a RESET returned to the default (not
    /// listed).
    pub set_by_client: &'a [(String, String)],
    /// Stands for both (a digest: equal means equal).
    pub fingerprint: ParamsFingerprint,
}

impl Wanted<'_> {
    fn set_by_client(&self, name: &str) -> bool {
        self.set_by_client.iter().any(|(n, _)| n == name)
    }
}

/// A server connection's record of its parameters.
#[derive(Debug)]
pub struct ServerParams {
    /// The reported parameters as the server reported them at login.
    base: HashMap<String, String>,
    /// The reported parameters as last reported, and the settings of
    /// unreported ones that differ from the base (absent: at the base).
    now: HashMap<String, String>,
    /// Reported parameters whose value was set in the session (by usher or
    /// read back so), where it may equal the base: a RESET of those changes
    /// what the server's session says of them, not their value. (An
    /// unreported one in `now` is set in the session.)
    set: Vec<String>,
    /// The wanted parameters `now` was last found in line with; cleared
    /// whenever `now` changes, so a match means nothing needs setting.
    in_line_with: Option<ParamsFingerprint>,
}

impl ServerParams {
    /// From the ParameterStatus messages of the login.
    pub fn new(reported: HashMap<String, String>) -> Self {
        ServerParams {
            now: reported.clone(),
            base: reported,
            set: Vec::new(),
            in_line_with: None,
        }
    }

    /// The reported parameters as the server reported them at login.
    pub fn base(&self) -> &HashMap<String, String> {
        &self.base
    }

    /// A parameter's value now, if reported or set by usher.
    pub fn get(&self, name: &str) -> Option<&String> {
        self.now.get(name)
    }

    /// Every parameter usher knows the value of now: the reported ones,
    /// and the unreported ones not at the base.
    pub fn now(&self) -> &HashMap<String, String> {
        &self.now
    }

    /// The server reports this parameter (ParameterStatus).
    pub fn is_reported(&self, name: &str) -> bool {
        self.base.contains_key(name)
    }

    /// Whether `name` is no longer at the base (its value, or set in the
    /// session).
    fn changed(&self, name: &str) -> bool {
        self.now.get(name) != self.base.get(name) || self.set.iter().any(|n| n == name)
    }

    fn mark_set(&mut self, name: &str, set: bool) {
        self.set.retain(|n| n != name);
        if set {
            self.set.push(name.to_string());
        }
    }

    /// A ParameterStatus from the server.
    pub fn reported(&mut self, name: &str, value: &str) {
        if self.now.get(name).map(String::as_str) != Some(value) {
            self.in_line_with = None;
            self.now.insert(name.to_string(), value.to_string());
        }
    }

    /// Every setting went back to the base (DISCARD ALL, RESET ALL): the
    /// unreported ones are gone (the server reports the others).
    pub fn all_reset(&mut self) {
        self.in_line_with = None;
        let base = &self.base;
        self.now.retain(|k, _| base.contains_key(k));
        self.set.clear();
    }

    /// What the session has set, as the server said (name, value as SHOW
    /// gives it; `role` is unset when `none`, session_authorization when it
    /// is the base): the unreported settings become exactly those, and the
    /// reported ones listed are set in the session.
    pub fn read_back(&mut self, read: &[(String, String)]) {
        self.in_line_with = None;
        let base = &self.base;
        self.now.retain(|k, _| base.contains_key(k));
        self.set.clear();
        for (name, value) in read {
            let unset = SERVER_SET.contains(&name.as_str())
                || (name == ROLE && value == "none")
                || (name == SESSION_AUTHORIZATION && self.base.get(name) == Some(value));
            if unset {
            } else if self.base.contains_key(name) {
                self.set.push(name.clone());
            } else {
                self.now.insert(name.clone(), value.clone());
            }
        }
    }

    /// The parameters `now` is in line with, if it has not changed since.
    pub fn in_line_with(&self) -> Option<&ParamsFingerprint> {
        self.in_line_with.as_ref()
    }

    /// Marks the connection in line with `wanted` if it is: nothing would
    /// be set.
    pub fn mark_in_line(&mut self, wanted: Wanted<'_>) {
        if self.in_line_with != Some(wanted.fingerprint) && self.settings_for(wanted).is_empty() {
            self.in_line_with = Some(wanted.fingerprint);
        }
    }

    /// The settings that make this connection what a fresh one would be
    /// with `wanted` (canonical names, values as a startup packet gives
    /// them) applied: every parameter not wanted and not at the base goes
    /// back to it; every wanted one not in place is applied from the base
    /// (reset first if another value is in place; a value the client set
    /// is set in the session). Resets of the identity
    /// (session_authorization, role) first, then the others by name, then
    /// session_authorization and role: on a connection whose identity is
    /// not the login's, that identity is reset first and made again last.
    pub fn settings_for(&self, wanted: Wanted<'_>) -> Vec<Setting> {
        let mut settings = Vec::new();
        for (name, value) in wanted.params {
            // (A server-set name here came in the startup packet: applied,
            // it fails as it would directly, 55P02.)
            let in_place = self.now.get(name).or_else(|| self.base.get(name)) == Some(value)
                && (!self.base.contains_key(name)
                    || !wanted.set_by_client(name)
                    || self.set.iter().any(|n| n == name));
            if in_place {
                continue;
            }
            if self.changed(name) && !SERVER_SET.contains(&name.as_str()) {
                settings.push(Setting {
                    name: name.clone(),
                    value: None,
                });
            }
            settings.push(Setting {
                name: name.clone(),
                value: Some(value.clone()),
            });
        }
        let is_wanted = |name: &str| wanted.params.iter().any(|(n, _)| n == name);
        settings.extend(
            self.now
                .keys()
                .chain(self.set.iter().filter(|n| !self.now.contains_key(*n)))
                .filter(|k| !SERVER_SET.contains(&k.as_str()))
                .filter(|k| self.changed(k) && !is_wanted(k))
                .map(|name| Setting {
                    name: name.clone(),
                    value: None,
                }),
        );
        if !settings.is_empty() && (self.changed(SESSION_AUTHORIZATION) || self.changed(ROLE)) {
            // The connection is under another identity, which may not make
            // the other settings: back to the login's first, made again
            // last (a wanted one in place too: the reset undid it).
            settings.retain(|s| !is_identity(&s.name));
            for name in [SESSION_AUTHORIZATION, ROLE] {
                if self.changed(name) {
                    settings.push(Setting {
                        name: name.to_string(),
                        value: None,
                    });
                }
                if let Some((_, value)) = wanted.params.iter().find(|(n, _)| n == name) {
                    settings.push(Setting {
                        name: name.to_string(),
                        value: Some(value.clone()),
                    });
                }
            }
        }
        // Stable: a reset stays before the setting of the same name.
        let rank = |s: &Setting| match (s.name.as_str(), s.value.is_some()) {
            (SESSION_AUTHORIZATION | ROLE, false) => 0,
            (SESSION_AUTHORIZATION, true) => 2,
            (ROLE, true) => 3,
            _ => 1,
        };
        settings.sort_by(|a, b| (rank(a), &a.name).cmp(&(rank(b), &b.name)));
        settings
    }

    /// `settings` were applied (the server's ParameterStatus messages are
    /// in already): unreported parameters take their values (the server's
    /// spelling of those is learnt when the session reads them back).
    fn applied(&mut self, settings: &[Setting]) {
        self.in_line_with = None;
        for s in settings {
            if self.base.contains_key(&s.name) {
                self.mark_set(&s.name, s.value.is_some());
                continue;
            }
            match &s.value {
                Some(v) => self.now.insert(s.name.clone(), v.clone()),
                None => self.now.remove(&s.name),
            };
        }
    }
}

/// A setting put back inside a transaction block, where it is part of the
/// transaction (a ROLLBACK undoes it with what it repairs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restore {
    pub name: String,
    pub value: String,
    /// SET LOCAL (the reset was SET LOCAL ... TO DEFAULT).
    pub local: bool,
}

impl ServerConn {
    /// The connection's parameters.
    pub fn params(&self) -> &ServerParams {
        &self.params
    }

    /// A ParameterStatus the server sent (forwarded to a client).
    pub fn note_parameter(&mut self, name: &str, value: &str) {
        self.params.reported(name, value);
    }

    /// Every setting went back to the base (a DISCARD ALL or RESET ALL ran).
    pub fn settings_reset(&mut self) {
        self.params.all_reset();
    }

    /// Runs a statement meant to reset the session (session mode's
    /// `server_reset_query`, DISCARD ALL) and keeps the record true: DISCARD
    /// ALL and RESET ALL take every setting back to the base; after anything
    /// else the settings are read back.
    pub async fn reset_session(&mut self, sql: &str) -> Result<(), QueryError> {
        self.simple_query(sql).await?;
        let words: Vec<String> = sql
            .trim()
            .trim_end_matches(';')
            .split_whitespace()
            .map(str::to_ascii_uppercase)
            .collect();
        if words == ["DISCARD", "ALL"] || words == ["RESET", "ALL"] {
            self.params.all_reset();
        } else {
            let custom: Vec<String> = self
                .params
                .now
                .keys()
                .filter(|k| k.contains('.'))
                .cloned()
                .collect();
            self.session_settings(&custom).await?;
        }
        Ok(())
    }

    /// Brings the connection in line with `wanted`, then runs `then_sql` (usher's own statements, or nothing), in
    /// one round trip; nothing at all if the connection was last found in
    /// line with the same and has not changed since. The NOTICEs the server
    /// raises are appended to `notices`, if given (a login passes them on).
    /// Returns the server's spelling of wanted reported parameters where it
    /// differs from the wanted value (`ISO, MDY` for `iso`), for the session
    /// to take, after which it marks the connection in line
    /// ([`ServerConn::mark_in_line`]).
    pub async fn bring_in_line(
        &mut self,
        wanted: Wanted<'_>,
        then_sql: &str,
        notices: Option<&mut bytes::BytesMut>,
    ) -> Result<Vec<(String, String)>, QueryError> {
        let settings = if self.params.in_line_with == Some(wanted.fingerprint) {
            Vec::new()
        } else {
            self.params.settings_for(wanted)
        };
        if settings.is_empty() && then_sql.is_empty() {
            self.params.in_line_with = Some(wanted.fingerprint);
            return Ok(Vec::new());
        }
        self.apply(&settings, then_sql, notices).await?;
        self.params.applied(&settings);
        Ok(wanted
            .params
            .iter()
            .filter_map(|(name, value)| {
                let now = self.params.base.get(name).and(self.params.now.get(name))?;
                (now != value).then(|| (name.clone(), now.clone()))
            })
            .collect())
    }

    /// After [`ServerConn::bring_in_line`] and the session took the
    /// spellings: the connection is in line with `wanted` (if it is).
    pub fn mark_in_line(&mut self, wanted: Wanted<'_>) {
        self.params.mark_in_line(wanted);
    }

    /// Inside a transaction block, after the client's RESET: puts the
    /// client's own values back, as SET (which takes no snapshot, so the
    /// transaction is as the client left it), or set_config() for a list of
    /// names (SET would quote the list as one name). The ParameterStatus
    /// messages the server sends update the record.
    pub async fn restore(&mut self, restores: &[Restore]) -> Result<(), QueryError> {
        let mut statements = Vec::new();
        for r in restores {
            if !r
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_$.".contains(&b))
            {
                continue;
            }
            let value = literal(&r.value);
            if LIST_QUOTED.contains(&r.name.as_str()) {
                statements.push(format!(
                    "SELECT FROM pg_catalog.set_config('{}', {value}, {})",
                    r.name, r.local
                ));
            } else {
                let scope = if r.local { "LOCAL " } else { "" };
                statements.push(format!("SET {scope}{} TO {value}", r.name));
            }
        }
        if statements.is_empty() {
            return Ok(());
        }
        // usher's own statements, one at a time (the extended protocol
        // takes one per Parse), so the client's unnamed statement and
        // portal are left as they were.
        let mut out = bytes::BytesMut::new();
        for sql in &statements {
            super::own_statement(sql, &mut out).map_err(|e| QueryError::Encode(e.to_string()))?;
        }
        postgres_protocol::message::frontend::sync(&mut out);
        self.exchange(&out, 1, |_| {}).await
    }
}

/// A string literal whatever standard_conforming_strings says: E'' with
/// backslashes and quotes doubled.
fn literal(value: &str) -> String {
    format!("E'{}'", value.replace('\\', "\\\\").replace('\'', "''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
        p.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn params() -> ServerParams {
        ServerParams::new(
            pairs(&[
                ("DateStyle", "ISO, MDY"),
                ("session_authorization", "alice"),
                ("is_superuser", "off"),
            ])
            .into_iter()
            .collect(),
        )
    }

    const F: ParamsFingerprint = ParamsFingerprint([1; 16]);

    fn wanted(params: &[(String, String)]) -> Wanted<'_> {
        Wanted {
            params,
            set_by_client: &[],
            fingerprint: F,
        }
    }

    fn names(settings: &[Setting]) -> Vec<(&str, Option<&str>)> {
        settings
            .iter()
            .map(|s| (s.name.as_str(), s.value.as_deref()))
            .collect()
    }

    #[test]
    fn a_value_is_applied_from_the_base() {
        let mut p = params();
        let iso = pairs(&[("DateStyle", "iso")]);
        assert!(p
            .settings_for(wanted(&pairs(&[("DateStyle", "ISO, MDY")])))
            .is_empty());
        assert_eq!(
            names(&p.settings_for(wanted(&iso))),
            [("DateStyle", Some("iso"))]
        );
        // Another session left German: back to the base first, so `iso`
        // keeps the base's field order.
        p.reported("DateStyle", "German, DMY");
        assert_eq!(
            names(&p.settings_for(wanted(&iso))),
            [("DateStyle", None), ("DateStyle", Some("iso"))]
        );
        assert_eq!(names(&p.settings_for(wanted(&[]))), [("DateStyle", None)]);
    }

    #[test]
    fn the_other_settings_are_made_under_the_logins_own_identity() {
        let mut p = params();
        // A client made a superuser-only setting, then took a role.
        let wanted_now = pairs(&[("session_replication_role", "replica"), ("role", "sub")]);
        let settings = p.settings_for(wanted(&wanted_now));
        assert_eq!(
            names(&settings),
            [
                ("session_replication_role", Some("replica")),
                ("role", Some("sub"))
            ]
        );
        p.applied(&settings);
        assert!(p.settings_for(wanted(&wanted_now)).is_empty());
        // A client of the same role that made no such setting: the reset
        // is made as the login's user, and the role is taken again.
        assert_eq!(
            names(&p.settings_for(wanted(&pairs(&[("role", "sub")])))),
            [
                ("role", None),
                ("session_replication_role", None),
                ("role", Some("sub"))
            ]
        );
        // A session authorization the connection has, wanted again with
        // another setting: undone first, made again last (role after it).
        p.reported("session_authorization", "bob");
        p.applied(&[Setting {
            name: "role".into(),
            value: None,
        }]);
        let bob = pairs(&[("session_authorization", "bob"), ("work_mem", "8MB")]);
        assert_eq!(
            names(&p.settings_for(wanted(&bob))),
            [
                ("session_authorization", None),
                ("session_replication_role", None),
                ("work_mem", Some("8MB")),
                ("session_authorization", Some("bob"))
            ]
        );
    }

    #[test]
    fn unreported_settings_are_recorded_and_reset() {
        let mut p = params();
        let list = pairs(&[("work_mem", "8MB"), ("session_authorization", "bob")]);
        let settings = p.settings_for(wanted(&list));
        // The identity last: work_mem is set as the login's user.
        assert_eq!(
            names(&settings),
            [
                ("work_mem", Some("8MB")),
                ("session_authorization", Some("bob"))
            ]
        );
        p.applied(&settings);
        p.reported("session_authorization", "bob");
        assert!(p.settings_for(wanted(&list)).is_empty());
        assert_eq!(
            names(&p.settings_for(wanted(&[]))),
            [("session_authorization", None), ("work_mem", None)]
        );
        p.read_back(&pairs(&[
            ("role", "none"),
            ("statement_timeout", "5s"),
            ("session_authorization", "alice"),
        ]));
        assert_eq!(p.get("work_mem"), None);
        assert_eq!(p.get("role"), None);
        assert_eq!(p.get("statement_timeout").map(String::as_str), Some("5s"));
        p.all_reset();
        assert_eq!(p.get("statement_timeout"), None);
    }

    #[test]
    fn a_value_the_client_set_is_set_in_the_session_even_at_the_base() {
        let mut p = params();
        let list = pairs(&[("DateStyle", "ISO, MDY")]);
        let by_client = Wanted {
            params: &list,
            set_by_client: &list,
            fingerprint: F,
        };
        // At the base by default: set all the same, so a RESET can be told
        // from it when the session reads its settings back.
        let settings = p.settings_for(by_client);
        assert_eq!(names(&settings), [("DateStyle", Some("ISO, MDY"))]);
        p.applied(&settings);
        assert!(p.settings_for(by_client).is_empty());
        // A session that does not want it: back to the base, not set.
        assert_eq!(names(&p.settings_for(wanted(&[]))), [("DateStyle", None)]);
        // Read back as not set in the session (a RESET): set again.
        p.read_back(&[]);
        assert_eq!(
            names(&p.settings_for(by_client)),
            [("DateStyle", Some("ISO, MDY"))]
        );
        p.read_back(&list);
        assert!(p.settings_for(by_client).is_empty());
    }

    #[test]
    fn in_line_until_it_changes() {
        let mut p = params();
        let list = pairs(&[("DateStyle", "ISO, MDY")]);
        p.mark_in_line(wanted(&list));
        assert_eq!(p.in_line_with(), Some(&F));
        p.reported("DateStyle", "ISO, MDY");
        assert_eq!(p.in_line_with(), Some(&F), "the same value changes nothing");
        p.reported("DateStyle", "SQL, MDY");
        assert_eq!(p.in_line_with(), None);
        p.mark_in_line(wanted(&pairs(&[("DateStyle", "iso")])));
        assert_eq!(p.in_line_with(), None, "not in line: not marked");
    }

    #[test]
    fn literals_survive_any_quoting() {
        assert_eq!(literal(r"a'b\c"), r"E'a''b\\c'");
    }
}
