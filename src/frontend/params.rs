//! A session's parameters: what the client asked for (startup packet, and
//! SETs the server reported back), so that every server connection the
//! session uses is brought in line with it before it runs anything.

use crate::backend::server_params::SERVER_SET;
use crate::backend::{ParamsFingerprint, QueryError, ServerConn, ServerParams, Wanted};
use crate::protocol::PgError;
use bytes::BytesMut;
use std::collections::HashMap;

/// Startup-packet keys that are not parameters to SET.
const NOT_PARAMETERS: &[&str] = &["user", "database", "options", "replication"];

/// Server-reported parameters with mixed-case names; everything else is lower case.
const CANONICAL: &[&str] = &["DateStyle", "IntervalStyle", "TimeZone"];

/// The spelling PostgreSQL uses for a parameter name.
pub fn canonical_name(name: &str) -> String {
    CANONICAL
        .iter()
        .find(|c| c.eq_ignore_ascii_case(name))
        .map(|c| c.to_string())
        .unwrap_or_else(|| name.to_ascii_lowercase())
}

/// The parameters a session wants on its server connections.
///
/// Three layers, later ones winning: the startup packet (plus what
/// client_connection hooks set), session_start hooks, and the client's own
/// SETs. DISCARD ALL clears the last two, as RESET ALL on a direct
/// connection returns to the startup values.
#[derive(Debug, Clone, Default)]
pub struct SessionParams {
    startup: Layer,
    hook: Layer,
    client: Layer,
    /// The merged view, canonical names; values of reported parameters take
    /// the server's spelling after a sync. `None` while it is the startup
    /// layer alone (no hook or client values): most sessions, which then
    /// keep one map instead of two.
    wanted: Option<Layer>,
    /// The fingerprint of the merged view, made when first needed after it
    /// changed.
    fingerprint: Option<ParamsFingerprint>,
}

impl SessionParams {
    /// From the startup packet: every parameter except user/database, plus
    /// `-c name=value` / `--name=value` items of `options`. As PostgreSQL
    /// takes them: `options` first, so a parameter of its own wins.
    pub fn from_startup(startup: &[(String, String)]) -> Result<Self, PgError> {
        let mut wanted = Layer::default();
        for (_, v) in startup.iter().filter(|(k, _)| k == "options") {
            for (name, value) in parse_options(v)? {
                wanted.insert(canonical_name(&name), value);
            }
        }
        for (k, v) in startup {
            if !NOT_PARAMETERS.contains(&k.as_str()) && !k.starts_with("_pq_.") {
                wanted.insert(canonical_name(k), v.clone());
            }
        }
        wanted.0.shrink_to_fit();
        Ok(SessionParams {
            startup: wanted,
            ..Default::default()
        })
    }

    /// The merged view (see `wanted`).
    fn merged(&self) -> &Layer {
        self.wanted.as_ref().unwrap_or(&self.startup)
    }

    fn rebuild(&mut self) {
        self.fingerprint = None;
        if self.hook.is_empty() && self.client.is_empty() {
            self.wanted = None;
            return;
        }
        let mut wanted = self.startup.clone();
        wanted.extend(self.hook.iter().map(|(k, v)| (k.clone(), v.clone())));
        wanted.extend(self.client.iter().map(|(k, v)| (k.clone(), v.clone())));
        self.wanted = Some(wanted);
    }

    /// Parameters a client_connection hook set: they count as startup values.
    pub fn add_startup(&mut self, params: impl IntoIterator<Item = (String, String)>) {
        for (k, v) in params {
            self.startup.insert(canonical_name(&k), v);
        }
        self.startup.0.shrink_to_fit();
        self.rebuild();
    }

    /// Replaces what session_start hooks set.
    pub fn set_hook_params(&mut self, params: impl IntoIterator<Item = (String, String)>) {
        self.hook = params
            .into_iter()
            .map(|(k, v)| (canonical_name(&k), v))
            .collect();
        self.rebuild();
    }

    /// DISCARD ALL: forget the client's SETs and the session hooks' values.
    pub fn reset(&mut self) {
        self.hook.clear();
        self.client.clear();
        self.rebuild();
    }

    #[cfg(test)]
    pub fn get(&self, name: &str) -> Option<&str> {
        self.merged().get(name).map(String::as_str)
    }

    /// The server reported a new value (the client ran SET): keep it.
    pub fn observe(&mut self, name: &str, value: &str) {
        if SERVER_SET.contains(&name) {
            return;
        }
        self.client.insert(name.to_string(), value.to_string());
        self.fingerprint = None;
        match self.wanted.as_mut() {
            Some(wanted) => {
                wanted.insert(name.to_string(), value.to_string());
            }
            None => self.rebuild(),
        }
    }

    /// Parameter values to tell the client at login: the server's reported
    /// values, overridden by what the client asked for.
    /// In PostgreSQL's order: by name, whatever the case.
    pub fn initial_report<'a>(
        &'a self,
        server: &'a HashMap<String, String>,
    ) -> Vec<(&'a str, &'a str)> {
        let merged = self.merged();
        let mut out: Vec<(&str, &str)> = server
            .iter()
            .map(|(k, v)| (k.as_str(), merged.get(k).unwrap_or(v).as_str()))
            .collect();
        let folded = |name: &'a str| name.bytes().map(|b| b.to_ascii_lowercase());
        out.sort_unstable_by(|a, b| folded(a.0).cmp(folded(b.0)).then(a.0.cmp(b.0)));
        out
    }

    /// Brings `conn` in line with this session ([`ServerConn::bring_in_line`]),
    /// then runs `then_sql` (usher's own statements, or nothing), and takes
    /// the server's spelling of the values (`ISO, MDY` for `iso`); those
    /// that changed are returned, to be told to the client. A connection
    /// last found in line with the same wanted parameters (this session's,
    /// or another's that wanted the same) and unchanged since needs
    /// nothing, and that costs a comparison: the common case of a
    /// transaction-mode checkout.
    pub async fn bring_in_line(
        &mut self,
        conn: &mut ServerConn,
        then_sql: &str,
        notices: Option<&mut BytesMut>,
    ) -> Result<Vec<(String, String)>, QueryError> {
        let spellings = conn
            .bring_in_line(self.wanted_now(), then_sql, notices)
            .await?;
        let changed = self.take_spellings(spellings);
        conn.mark_in_line(self.wanted_now());
        Ok(changed)
    }

    /// What the session wants, as the server connection takes it.
    fn wanted_now(&mut self) -> Wanted<'_> {
        let fingerprint = self.fingerprint();
        Wanted {
            params: &self.merged().0,
            set_by_client: &self.client.0,
            fingerprint,
        }
    }

    /// A digest of the wanted parameters and of those the client set:
    /// SHA-256 of both, sorted, each name and value length-prefixed, cut
    /// to 128 bits.
    fn fingerprint(&mut self) -> ParamsFingerprint {
        if let Some(f) = self.fingerprint {
            return f;
        }
        use sha2::{Digest, Sha256};
        let mut hash = Sha256::new();
        for layer in [self.merged(), &self.client] {
            let mut entries: Vec<_> = layer.iter().collect();
            entries.sort();
            hash.update((entries.len() as u64).to_be_bytes());
            for (name, value) in entries {
                for part in [name, value] {
                    hash.update((part.len() as u64).to_be_bytes());
                    hash.update(part.as_bytes());
                }
            }
        }
        let digest = hash.finalize();
        let mut out = [0u8; 16];
        out.copy_from_slice(&digest[..16]);
        let f = ParamsFingerprint(out);
        self.fingerprint = Some(f);
        f
    }

    /// The server's spelling of wanted values (name, spelling): each layer
    /// takes it, so later comparisons match and a rebuild does not undo it.
    /// Returns them, to be told to the client.
    fn take_spellings(&mut self, spellings: Vec<(String, String)>) -> Vec<(String, String)> {
        for (name, value) in &spellings {
            self.take_spelling(name, value.clone());
        }
        spellings
    }
}

impl SessionParams {
    /// The names of custom settings (`myapp.tenant`) the session has.
    pub fn custom_names(&self) -> impl Iterator<Item = &String> {
        self.merged().keys().filter(|k| k.contains('.'))
    }

    /// The client's statements may have changed settings, and `read` is
    /// what the server connection's session now has set (name, value;
    /// `ServerConn::session_settings`). The client's own layer becomes
    /// what differs from its startup and hook values, so a SET is kept,
    /// a rolled-back one is not, and a reset returns to the startup value
    /// (the next sync brings it back).
    ///
    /// What the read leaves out is not set in the session: at the startup
    /// value (the client's own values are always set in the session, even
    /// where the server's default is the same: `Wanted::set_by_client`).
    /// `server` is the connection's record; `reset` says whether the
    /// statements may have reset a name: a custom setting reset reads as
    /// '' (its placeholder's value, which nothing tells from a SET to '')
    /// and is then taken as reset.
    pub fn settle(
        &mut self,
        read: Vec<(String, String)>,
        server: &ServerParams,
        reset: impl Fn(&str) -> bool,
    ) {
        let mut base = self.startup.clone();
        base.extend(self.hook.iter().map(|(k, v)| (k.clone(), v.clone())));
        self.client.clear();
        for (name, value) in &read {
            let unset = match name.as_str() {
                "role" => value == "none",
                "session_authorization" => server.base().get(name) == Some(value),
                _ if name.contains('.') && value.is_empty() && base.contains_key(name) => {
                    reset(name)
                }
                _ => SERVER_SET.contains(&name.as_str()),
            };
            if !unset && base.get(name) != Some(value) {
                self.client.insert(name.clone(), value.clone());
            }
        }
        self.rebuild();
    }

    /// The merged parameters, canonical names, values as they stand.
    pub fn wanted(&self) -> impl Iterator<Item = (&String, &String)> {
        self.merged().iter()
    }

    /// What RESET returns `name` (a canonical name) to on a direct
    /// connection: the value the session started with (startup packet,
    /// client_connection and session_start hooks), if it has one; else the
    /// server's default.
    pub fn reset_value(&self, name: &str) -> Option<&String> {
        self.hook.get(name).or_else(|| self.startup.get(name))
    }

    /// The names of the parameters the session started with.
    pub fn started_with(&self) -> impl Iterator<Item = &String> {
        self.startup
            .keys()
            .chain(self.hook.keys().filter(|k| !self.startup.contains_key(k)))
    }

    /// The value the client was last told of a reported parameter: its
    /// own, or the server's default (`defaults`).
    pub fn told<'a>(
        &'a self,
        name: &str,
        defaults: &'a HashMap<String, String>,
    ) -> Option<&'a String> {
        self.merged().get(name).or_else(|| defaults.get(name))
    }

    /// Takes the server's spelling of a wanted value, learnt elsewhere (a
    /// pool's memory of earlier logins).
    pub fn take_spelling(&mut self, name: &str, value: String) {
        let layered = self.wanted.is_some();
        let wanted = self.wanted.as_mut().unwrap_or(&mut self.startup);
        if let Some(v) = wanted.get_mut(name) {
            self.fingerprint = None;
            *v = value.clone();
            if layered {
                respell(
                    [&mut self.client, &mut self.hook, &mut self.startup],
                    name,
                    value,
                );
            }
        }
    }
}

/// One layer of parameters: a few (name, value) pairs, so a list (a hash
/// map keeps room for four at least, and every session has layers).
#[derive(Debug, Clone, Default)]
struct Layer(Vec<(String, String)>);

impl Layer {
    fn get(&self, name: &str) -> Option<&String> {
        self.0.iter().find(|(k, _)| k == name).map(|(_, v)| v)
    }

    fn get_mut(&mut self, name: &str) -> Option<&mut String> {
        self.0.iter_mut().find(|(k, _)| k == name).map(|(_, v)| v)
    }

    fn contains_key(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    fn insert(&mut self, name: String, value: String) {
        match self.get_mut(&name) {
            Some(v) => *v = value,
            None => self.0.push((name, value)),
        }
    }

    fn extend(&mut self, pairs: impl IntoIterator<Item = (String, String)>) {
        for (k, v) in pairs {
            self.insert(k, v);
        }
    }

    fn iter(&self) -> impl Iterator<Item = (&String, &String)> {
        self.0.iter().map(|(k, v)| (k, v))
    }

    fn keys(&self) -> impl Iterator<Item = &String> {
        self.0.iter().map(|(k, _)| k)
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn clear(&mut self) {
        self.0.clear();
    }
}

impl FromIterator<(String, String)> for Layer {
    fn from_iter<I: IntoIterator<Item = (String, String)>>(pairs: I) -> Self {
        let mut layer = Layer::default();
        layer.extend(pairs);
        layer
    }
}

/// Gives the value of `name` in the first layer that has it (the one that
/// wins) the server's spelling.
fn respell(layers: [&mut Layer; 3], name: &str, value: String) {
    if let Some(layer) = layers.into_iter().find(|l| l.contains_key(name)) {
        layer.insert(name.to_string(), value);
    }
}

/// Splits the `options` startup parameter into (name, value) settings.
fn parse_options(options: &str) -> Result<Vec<(String, String)>, PgError> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut chars = options.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => word.extend(chars.next()),
            c if c.is_whitespace() => {
                if !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
            }
            c => word.push(c),
        }
    }
    if !word.is_empty() {
        words.push(word);
    }
    let mut out = Vec::new();
    let mut it = words.into_iter();
    let bad = |w: &str| {
        PgError::fatal(
            crate::protocol::error::sqlstate::FEATURE_NOT_SUPPORTED,
            format!(
                "unsupported startup option \"{}\": usher accepts only -c name=value and --name=value",
                crate::protocol::error::shown(w, 64)
            ),
        )
    };
    while let Some(w) = it.next() {
        let setting = if w == "-c" {
            it.next().ok_or_else(|| bad(&w))?
        } else if let Some(rest) = w.strip_prefix("-c") {
            rest.to_string()
        } else if let Some(rest) = w.strip_prefix("--") {
            rest.to_string()
        } else {
            return Err(bad(&w));
        };
        let (name, value) = setting.split_once('=').ok_or_else(|| bad(&setting))?;
        out.push((name.replace('-', "_"), value.to_string()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_parsed() {
        let got =
            parse_options("-c statement_timeout=5s --search-path=a,b -cwork_mem=4MB -c x=a\\ b")
                .unwrap();
        assert_eq!(
            got,
            vec![
                ("statement_timeout".into(), "5s".into()),
                ("search_path".into(), "a,b".into()),
                ("work_mem".into(), "4MB".into()),
                ("x".into(), "a b".into()),
            ]
        );
        assert!(parse_options("-d 5").is_err());
    }

    #[test]
    fn startup_keeps_parameters_only() {
        let startup = vec![
            ("user".into(), "u".into()),
            ("database".into(), "d".into()),
            ("datestyle".into(), "ISO".into()),
            ("options".into(), "-c search_path=x".into()),
        ];
        let p = SessionParams::from_startup(&startup).unwrap();
        assert_eq!(p.get("DateStyle"), Some("ISO"));
        assert_eq!(p.get("search_path"), Some("x"));
        assert_eq!(p.get("user"), None);
    }

    #[test]
    fn a_parameter_of_its_own_wins_over_options() {
        let startup = vec![
            ("DateStyle".into(), "SQL".into()),
            (
                "options".into(),
                "-c datestyle=German -c work_mem=8MB".into(),
            ),
        ];
        let p = SessionParams::from_startup(&startup).unwrap();
        assert_eq!(p.get("DateStyle"), Some("SQL"));
        assert_eq!(p.get("work_mem"), Some("8MB"));
    }

    #[test]
    fn settle_takes_what_the_session_has_set() {
        let startup = vec![(
            "options".into(),
            "-c TimeZone=Asia/Kolkata -c app.x=a".into(),
        )];
        let mut p = SessionParams::from_startup(&startup).unwrap();
        let server = ServerParams::new(
            [("TimeZone".to_string(), "Etc/UTC".to_string())]
                .into_iter()
                .collect(),
        );
        // The client SET TimeZone to the server's default: listed.
        let utc = vec![("TimeZone".to_string(), "Etc/UTC".to_string())];
        p.settle(utc, &server, |_| false);
        assert_eq!(p.get("TimeZone"), Some("Etc/UTC"));
        // Not listed: reset, back to the startup value.
        p.settle(Vec::new(), &server, |_| false);
        assert_eq!(p.get("TimeZone"), Some("Asia/Kolkata"));
        // A custom setting read as '' is a SET to '', unless it was reset.
        let read = vec![("app.x".to_string(), String::new())];
        p.settle(read.clone(), &server, |_| false);
        assert_eq!(p.get("app.x"), Some(""));
        p.settle(read, &server, |name| name == "app.x");
        assert_eq!(p.get("app.x"), Some("a"));
    }

    #[test]
    fn layers_and_reset() {
        let startup = vec![
            ("application_name".into(), "app".into()),
            ("user".into(), "u".into()),
        ];
        let mut p = SessionParams::from_startup(&startup).unwrap();
        p.add_startup([("search_path".to_string(), "a".to_string())]);
        p.set_hook_params([
            ("search_path".to_string(), "b".to_string()),
            ("work_mem".to_string(), "8MB".to_string()),
        ]);
        p.observe("application_name", "changed");
        assert_eq!(p.get("search_path"), Some("b"));
        assert_eq!(p.get("application_name"), Some("changed"));
        p.reset();
        assert_eq!(p.get("search_path"), Some("a"));
        assert_eq!(p.get("application_name"), Some("app"));
        assert_eq!(p.get("work_mem"), None);
    }
}
