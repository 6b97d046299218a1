//! What a client's SQL text may do to its session, read cheaply: the
//! first keyword of each statement (after whitespace and comments), and
//! the names of the functions that change settings. No SQL parser: a
//! scan of the bytes that skips string literals, quoted identifiers,
//! dollar-quoted bodies and comments.
//!
//! The scan errs toward "may": a false alarm costs one small query (the
//! session reads its settings back), a miss would let a setting stay on a
//! server connection another client gets.

/// What a statement text may do to the session, beyond its transaction.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Effects {
    /// It may change a session setting: SET (not SET LOCAL / SET
    /// TRANSACTION / SET CONSTRAINTS), RESET, SET ROLE, SET SESSION
    /// AUTHORIZATION, DISCARD, set_config(), or a DO block (whose body is
    /// not read).
    pub settings: bool,
    /// Custom settings (`myapp.tenant`) it names in a SET, RESET or
    /// set_config('...'), lower case: the server lists no custom setting,
    /// so the session asks for these by name.
    pub custom: Vec<String>,
}

impl Effects {
    /// What a text usher could not read whole may do: anything.
    pub fn unknown() -> Effects {
        Effects {
            settings: true,
            custom: Vec::new(),
        }
    }

    /// Adds what another text may do.
    pub fn add(&mut self, other: Effects) {
        self.settings |= other.settings;
        for name in other.custom {
            if !self.custom.contains(&name) {
                self.custom.push(name);
            }
        }
    }
}

/// The effects of a Query message's text (one or more statements).
pub fn scan(sql: &[u8]) -> Effects {
    let mut effects = Effects::default();
    let mut at = 0;
    let mut statement_start = true;
    let mut words_in_statement = 0;
    let mut first = Keyword::Other;
    let mut set_session = false;
    while at < sql.len() {
        let b = sql[at];
        match b {
            b';' => {
                statement_start = true;
                words_in_statement = 0;
                at += 1;
            }
            b'\'' => at = skip_quoted(sql, at, b'\'', backslashes_escape(sql, at)),
            b'"' => at = skip_quoted(sql, at, b'"', false),
            b'-' if sql.get(at + 1) == Some(&b'-') => at = skip_line(sql, at),
            b'/' if sql.get(at + 1) == Some(&b'*') => at = skip_block_comment(sql, at),
            b'$' if is_dollar_quote_start(sql, at) => at = skip_dollar_quoted(sql, at),
            _ if is_word_start(b) => {
                let end = word_end(sql, at);
                let word = &sql[at..end];
                if statement_start {
                    first = Keyword::of(word);
                    statement_start = false;
                    words_in_statement = 1;
                    match first {
                        Keyword::Reset | Keyword::Discard | Keyword::Do => effects.settings = true,
                        Keyword::Set | Keyword::Other => {}
                    }
                } else {
                    words_in_statement += 1;
                    if words_in_statement == 2 {
                        set_session = word.eq_ignore_ascii_case(b"session");
                    }
                    if first == Keyword::Set && words_in_statement == 2 {
                        // SET LOCAL, SET TRANSACTION and SET CONSTRAINTS
                        // end with the transaction; every other SET lasts.
                        let local = ["local", "transaction", "constraints"]
                            .iter()
                            .any(|k| word.eq_ignore_ascii_case(k.as_bytes()));
                        effects.settings |= !local;
                    }
                    // The setting's name: SET [SESSION] name, RESET name.
                    let name_word = match first {
                        Keyword::Set => {
                            words_in_statement == 2 && !set_session
                                || words_in_statement == 3 && set_session
                        }
                        Keyword::Reset => words_in_statement == 2,
                        _ => false,
                    };
                    if name_word {
                        effects.note_custom(custom_name(sql, at));
                    }
                }
                if word.eq_ignore_ascii_case(b"set_config") {
                    effects.settings = true;
                    effects.note_custom(first_literal_argument(sql, end));
                }
                at = end;
            }
            _ => at += 1,
        }
    }
    // A lone SET (no second word) is a syntax error: no effect.
    effects
}

impl Effects {
    fn note_custom(&mut self, name: Option<String>) {
        if let Some(name) = name.filter(|n| n.contains('.')) {
            if !self.custom.contains(&name) {
                self.custom.push(name);
            }
        }
    }
}

/// A dotted setting name at `at` (`myapp.tenant`), lower case, or `None`
/// if what is there is not one (only plain name characters are taken, so
/// the name is safe to quote in usher's own SQL).
fn custom_name(sql: &[u8], at: usize) -> Option<String> {
    let end = sql[at..]
        .iter()
        .position(|b| !(b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'$')))
        .map_or(sql.len(), |p| at + p);
    let name = std::str::from_utf8(&sql[at..end]).ok()?;
    (name.contains('.') && !name.starts_with('.') && !name.ends_with('.'))
        .then(|| name.to_ascii_lowercase())
}

/// The name in `set_config('name', ...)`, after the function's name.
fn first_literal_argument(sql: &[u8], mut at: usize) -> Option<String> {
    let skip_space = |at: &mut usize| {
        while sql.get(*at).is_some_and(|b| b.is_ascii_whitespace()) {
            *at += 1;
        }
    };
    skip_space(&mut at);
    (sql.get(at) == Some(&b'(')).then_some(())?;
    at += 1;
    skip_space(&mut at);
    (sql.get(at) == Some(&b'\'')).then_some(())?;
    let name = custom_name(sql, at + 1)?;
    (sql.get(at + 1 + name.len()) == Some(&b'\'')).then_some(name)
}

/// The effects of a Parse message's body (name, text, parameter types);
/// a body that is not whole may do anything.
pub fn scan_parse(body: &[u8]) -> Effects {
    let text = body
        .iter()
        .position(|b| *b == 0)
        .map(|name_end| &body[name_end + 1..])
        .and_then(|rest| rest.iter().position(|b| *b == 0).map(|end| &rest[..end]));
    text.map_or_else(Effects::unknown, scan)
}

/// The effects of a Query message's body (the text and its NUL); a body
/// that is not whole may do anything.
pub fn scan_query(body: &[u8]) -> Effects {
    match body.split_last() {
        Some((0, text)) => scan(text),
        _ => Effects::unknown(),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keyword {
    Set,
    Reset,
    Discard,
    Do,
    Other,
}

impl Keyword {
    fn of(word: &[u8]) -> Keyword {
        if word.eq_ignore_ascii_case(b"set") {
            Keyword::Set
        } else if word.eq_ignore_ascii_case(b"reset") {
            Keyword::Reset
        } else if word.eq_ignore_ascii_case(b"discard") {
            Keyword::Discard
        } else if word.eq_ignore_ascii_case(b"do") {
            Keyword::Do
        } else {
            Keyword::Other
        }
    }
}

fn is_word_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_' || b >= 0x80
}

fn word_end(sql: &[u8], mut at: usize) -> usize {
    while at < sql.len() && (is_word_start(sql[at]) || sql[at].is_ascii_digit() || sql[at] == b'$')
    {
        at += 1;
    }
    at
}

/// `E'...'` strings take backslash escapes (and so may other strings when
/// standard_conforming_strings is off, which this does not know: reading
/// `\'` as an escape there errs toward seeing more statements, not fewer).
fn backslashes_escape(sql: &[u8], quote: usize) -> bool {
    quote > 0
        && matches!(sql[quote - 1], b'e' | b'E')
        && (quote < 2 || !is_word_start(sql[quote - 2]) && !sql[quote - 2].is_ascii_digit())
}

/// Past a quoted string or identifier starting at `at`; a doubled quote
/// stands for itself.
fn skip_quoted(sql: &[u8], at: usize, quote: u8, backslashes: bool) -> usize {
    let mut i = at + 1;
    while i < sql.len() {
        match sql[i] {
            b'\\' if backslashes => i += 2,
            c if c == quote => {
                if sql.get(i + 1) == Some(&quote) {
                    i += 2;
                } else {
                    return i + 1;
                }
            }
            _ => i += 1,
        }
    }
    sql.len()
}

fn skip_line(sql: &[u8], at: usize) -> usize {
    sql[at..]
        .iter()
        .position(|b| *b == b'\n')
        .map_or(sql.len(), |p| at + p + 1)
}

/// Past a `/* ... */` comment; they nest in PostgreSQL.
fn skip_block_comment(sql: &[u8], at: usize) -> usize {
    let mut depth = 0;
    let mut i = at;
    while i + 1 < sql.len() {
        match (sql[i], sql[i + 1]) {
            (b'/', b'*') => {
                depth += 1;
                i += 2;
            }
            (b'*', b'/') => {
                depth -= 1;
                i += 2;
                if depth == 0 {
                    return i;
                }
            }
            _ => i += 1,
        }
    }
    sql.len()
}

/// `$tag$` or `$$` where a token may start (not `$1`, not inside a word).
fn is_dollar_quote_start(sql: &[u8], at: usize) -> bool {
    if at > 0 && (is_word_start(sql[at - 1]) || sql[at - 1].is_ascii_digit()) {
        return false;
    }
    dollar_tag_len(sql, at).is_some()
}

/// The length of the `$tag$` at `at`, if there is one.
fn dollar_tag_len(sql: &[u8], at: usize) -> Option<usize> {
    let mut i = at + 1;
    if sql.get(i).is_some_and(|b| b.is_ascii_digit()) {
        return None;
    }
    while i < sql.len() && (is_word_start(sql[i]) || sql[i].is_ascii_digit()) {
        i += 1;
    }
    (sql.get(i) == Some(&b'$')).then_some(i + 1 - at)
}

fn skip_dollar_quoted(sql: &[u8], at: usize) -> usize {
    let len = dollar_tag_len(sql, at).expect("a dollar quote starts here");
    let tag = &sql[at..at + len];
    let body = at + len;
    sql[body..]
        .windows(len)
        .position(|w| w == tag)
        .map_or(sql.len(), |p| body + p + len)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(sql: &str) -> bool {
        scan(sql.as_bytes()).settings
    }

    #[test]
    fn sets_that_last_are_seen() {
        for sql in [
            "SET search_path = a, b",
            "set statement_timeout to '5s'",
            "SET SESSION work_mem = '8MB'",
            "SET TIME ZONE 'UTC'",
            "SET ROLE reader",
            "SET SESSION AUTHORIZATION bob",
            "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY",
            "RESET ALL",
            "reset datestyle",
            "DISCARD ALL",
            "SELECT set_config('myapp.tenant', '42', false)",
            "select 1; set search_path = x",
            "  -- a comment\n  /* and /* nested */ one */ SET x.y = 1",
            "BEGIN; SET statement_timeout = 1; COMMIT",
            "DO $$ BEGIN PERFORM 1; END $$",
        ] {
            assert!(settings(sql), "{sql}");
        }
    }

    #[test]
    fn statements_that_change_no_setting_are_not() {
        for sql in [
            "SELECT abalance FROM pgbench_accounts WHERE aid = 1",
            "SET LOCAL statement_timeout = 1",
            "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE",
            "SET CONSTRAINTS ALL DEFERRED",
            "UPDATE t SET x = 1",
            "INSERT INTO t VALUES ('; SET x = 1')",
            "SELECT \"; reset all\" FROM t",
            "SELECT $$; SET a.b = 1$$",
            "SELECT $tag$ ; RESET ALL $tag$, 1",
            "SELECT E'it\\'s; SET a.b = 1'",
            "SELECT 'it''s; SET a.b = 1'",
            "-- SET a.b = 1\nSELECT 1",
            "/* RESET ALL */ SELECT 1",
            "CREATE FUNCTION f() RETURNS int SET search_path = a LANGUAGE sql AS 'SELECT 1'",
            "ALTER ROLE alice SET work_mem = '1MB'",
            "SELECT $1::int",
            "",
        ] {
            assert!(!settings(sql), "{sql}");
        }
    }

    #[test]
    fn custom_settings_are_named() {
        let custom = |sql: &str| scan(sql.as_bytes()).custom;
        assert_eq!(custom("SET myapp.tenant = 'a'"), ["myapp.tenant"]);
        assert_eq!(custom("set session MyApp.Tenant to 1"), ["myapp.tenant"]);
        assert_eq!(custom("RESET myapp.tenant"), ["myapp.tenant"]);
        assert_eq!(
            custom("SELECT set_config( 'a.b', '1', false), set_config('c.d', '2', false)"),
            ["a.b", "c.d"]
        );
        assert!(
            custom("SET search_path = a.b").is_empty(),
            "a value, not a name"
        );
        assert!(custom("SELECT set_config('x''; y.z', '1', false)").is_empty());
        assert!(custom("SELECT set_config($1, $2, false)").is_empty());
    }

    #[test]
    fn a_message_not_read_whole_may_do_anything() {
        assert!(scan_query(b"SELECT 1").settings, "no NUL: a head only");
        assert!(!scan_query(b"SELECT 1\0").settings);
        assert!(scan_query(b"SET a.b = 1\0").settings);
        assert!(!scan_parse(b"s1\0SELECT 1\0\0\0").settings);
        assert!(scan_parse(b"\0SET a.b = 1\0\0\0").settings);
        assert!(scan_parse(b"\0SELECT 1").settings, "cut text: unknown");
    }
}
