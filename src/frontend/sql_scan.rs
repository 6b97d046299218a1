//! What a client's SQL text may do to its session, read cheaply: the
//! first keyword of each statement (after whitespace and comments), and
//! the names of the functions that change settings. No SQL parser: a
//! scan of the bytes that skips string literals, quoted identifiers,
//! dollar-quoted bodies and comments.
//!
//! The scan errs toward "may": a false alarm costs one small query (the
//! session reads its settings back), a miss would let a setting stay on a
//! server connection another client gets.
//!
//! It also sees the statements that leave state on the server connection
//! which cannot follow the client to another one ([`PinKinds`]: LISTEN,
//! session advisory locks, temporary objects, WITH HOLD cursors, SQL-level
//! PREPARE, LOAD), and those that may end it (UNLISTEN, the advisory
//! unlocks, DISCARD, DROP, CLOSE, DEALLOCATE): transaction mode keeps such
//! a client's server connection (`flow/`), and asks the server what is
//! left when a statement may have ended it. A bit set: no allocation.
//!
//! And it names the databases a statement needs no other session on
//! (`Effects::databases`: DROP DATABASE, ALTER DATABASE ... RENAME / SET
//! TABLESPACE, CREATE DATABASE's template), so that usher closes its own
//! idle server connections to them before the statement goes out. Only a
//! statement whose second word is DATABASE is read further.

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
    /// State it may leave on the server connection that cannot move to
    /// another one.
    pub pins: PinKinds,
    /// State it may end (the server is asked what is left).
    pub unpins: PinKinds,
    /// It may run a prepared statement by name ([`execute_references`]).
    pub executes: bool,
    /// Settings it may reset, in order: on a server connection a reset
    /// returns to the server's default, where on a direct connection it
    /// returns to the value the session started with.
    pub resets: Vec<Reset>,
    /// Databases it fails on while other sessions are connected to them
    /// (55006), as the server names them ([`database_target`]).
    pub databases: Vec<String>,
}

/// A reset a statement may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reset {
    /// RESET name, SET [SESSION | LOCAL] name TO DEFAULT (`local`: SET
    /// LOCAL): the name, unquoted parts lower case.
    One { name: String, local: bool },
    /// RESET ALL, DISCARD ALL.
    All,
    /// A DO block, or a text usher did not read: it may reset anything.
    Unknown,
}

/// Kinds of session state that tie a client to its server connection, as
/// a bit set.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct PinKinds(u8);

impl PinKinds {
    pub const NONE: PinKinds = PinKinds(0);
    /// LISTEN.
    pub const LISTEN: PinKinds = PinKinds(1);
    /// A session-level advisory lock (pg_advisory_lock[_shared],
    /// pg_try_advisory_lock[_shared]; not the _xact_ ones).
    pub const ADVISORY_LOCK: PinKinds = PinKinds(2);
    /// A temporary table, view, sequence or other object in pg_temp.
    pub const TEMP: PinKinds = PinKinds(4);
    /// A cursor declared WITH HOLD.
    pub const HOLD_CURSOR: PinKinds = PinKinds(8);
    /// A statement prepared with SQL PREPARE.
    pub const SQL_PREPARE: PinKinds = PinKinds(16);
    /// LOAD of a library: nothing unloads it.
    pub const LOAD: PinKinds = PinKinds(32);
    /// A text usher did not read (too large) or a DO block's body: it may
    /// have left any of the state the server can be asked about.
    pub const UNKNOWN: PinKinds = PinKinds(64);
    /// What the server can be asked about (the rest of the kinds but LOAD
    /// and UNKNOWN).
    pub const CHECKABLE: PinKinds = PinKinds(1 | 2 | 4 | 8 | 16);

    const NAMES: [(PinKinds, &'static str); 7] = [
        (PinKinds::LISTEN, "LISTEN"),
        (PinKinds::ADVISORY_LOCK, "a session advisory lock"),
        (PinKinds::TEMP, "a temporary object"),
        (PinKinds::HOLD_CURSOR, "a WITH HOLD cursor"),
        (PinKinds::SQL_PREPARE, "SQL PREPARE"),
        (PinKinds::LOAD, "LOAD"),
        (PinKinds::UNKNOWN, "a statement usher could not read"),
    ];

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Some kind of `other` is in this set.
    pub fn intersects(self, other: PinKinds) -> bool {
        self.0 & other.0 != 0
    }

    pub fn contains(self, other: PinKinds) -> bool {
        self.0 & other.0 == other.0
    }

    /// The kinds of this set that are not in `other`.
    pub fn without(self, other: PinKinds) -> PinKinds {
        PinKinds(self.0 & !other.0)
    }

    /// The kinds in both sets.
    pub fn and(self, other: PinKinds) -> PinKinds {
        PinKinds(self.0 & other.0)
    }

    /// Each kind in the set, named for a person ("LISTEN, a temporary
    /// object").
    pub fn describe(self) -> String {
        let names: Vec<&str> = Self::NAMES
            .iter()
            .filter(|(k, _)| self.contains(*k))
            .map(|(_, n)| *n)
            .collect();
        names.join(", ")
    }
}

impl std::ops::BitOr for PinKinds {
    type Output = PinKinds;
    fn bitor(self, other: PinKinds) -> PinKinds {
        PinKinds(self.0 | other.0)
    }
}

impl std::ops::BitOrAssign for PinKinds {
    fn bitor_assign(&mut self, other: PinKinds) {
        self.0 |= other.0;
    }
}

impl Effects {
    /// What a text usher could not read whole may do: anything.
    pub fn unknown() -> Effects {
        Effects {
            settings: true,
            custom: Vec::new(),
            pins: PinKinds::UNKNOWN,
            unpins: PinKinds::CHECKABLE,
            executes: false,
            resets: vec![Reset::Unknown],
            databases: Vec::new(),
        }
    }

    /// Adds what another text may do.
    pub fn add(&mut self, other: Effects) {
        self.settings |= other.settings;
        self.executes |= other.executes;
        self.pins |= other.pins;
        self.unpins |= other.unpins;
        for name in other.custom {
            if !self.custom.contains(&name) {
                self.custom.push(name);
            }
        }
        self.resets.extend(other.resets);
        for name in other.databases {
            if !self.databases.contains(&name) {
                self.databases.push(name);
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
    let mut first = Word::Other;
    let mut first_at = 0;
    let mut previous = Word::Other;
    let mut set_session = false;
    while at < sql.len() {
        let b = sql[at];
        // Most bytes are spaces, digits and punctuation the scan passes
        // over: one table look-up each.
        if CLASS[b as usize] == PLAIN {
            at += 1;
            continue;
        }
        match b {
            b';' => {
                statement_start = true;
                words_in_statement = 0;
                previous = Word::Other;
                at += 1;
            }
            b'\'' => at = skip_quoted(sql, at, b'\'', backslashes_escape(sql, at)),
            b'"' => {
                let end = skip_quoted(sql, at, b'"', false);
                // A quoted function name calls it all the same (only the
                // advisory lock functions matter: 16 bytes or more).
                let name = &sql[at + 1..end.saturating_sub(1).max(at + 1)];
                if name.len() >= 16 {
                    effects.note_function(Word::of(name));
                }
                previous = Word::Other;
                at = end;
            }
            b'-' if sql.get(at + 1) == Some(&b'-') => at = skip_line(sql, at),
            b'/' if sql.get(at + 1) == Some(&b'*') => at = skip_block_comment(sql, at),
            b'$' if is_dollar_quote_start(sql, at) => at = skip_dollar_quoted(sql, at),
            _ if is_word_start(b) => {
                let end = word_end(sql, at);
                let word = &sql[at..end];
                let kind = Word::of(word);
                // Most words: no keyword, past where a statement's second
                // and third words matter (or in a statement whose first
                // word is none of the scan's). Nothing below would act.
                if kind == Word::Other
                    && !statement_start
                    && (first == Word::Other || words_in_statement >= 3)
                {
                    words_in_statement += 1;
                    previous = Word::Other;
                    at = end;
                    continue;
                }
                if statement_start {
                    first = kind;
                    first_at = at;
                    statement_start = false;
                    words_in_statement = 1;
                    effects.note_first(first);
                    if matches!(first, Word::Set | Word::Reset | Word::Discard) {
                        effects.resets.extend(reset_at(sql, at));
                    }
                } else {
                    words_in_statement += 1;
                    if words_in_statement == 2 {
                        set_session = word.eq_ignore_ascii_case(b"session");
                        if kind == Word::Database
                            && matches!(first, Word::Drop | Word::Alter | Word::Create)
                        {
                            if let Some(name) = database_target(sql, first_at) {
                                if !effects.databases.contains(&name) {
                                    effects.databases.push(name);
                                }
                            }
                        }
                    }
                    if first == Word::Set && words_in_statement == 2 {
                        // SET LOCAL, SET TRANSACTION and SET CONSTRAINTS
                        // end with the transaction; every other SET lasts.
                        let local = ["local", "transaction", "constraints"]
                            .iter()
                            .any(|k| word.eq_ignore_ascii_case(k.as_bytes()));
                        effects.settings |= !local;
                    }
                    if first == Word::Prepare
                        && words_in_statement == 2
                        && kind != Word::Transaction
                    {
                        // PREPARE name AS ... (PREPARE TRANSACTION is
                        // two-phase commit: the transaction leaves the session).
                        effects.pins |= PinKinds::SQL_PREPARE;
                    }
                    // The setting's name: SET [SESSION] name, RESET name.
                    let name_word = match first {
                        Word::Set => {
                            words_in_statement == 2 && !set_session
                                || words_in_statement == 3 && set_session
                        }
                        Word::Reset => words_in_statement == 2,
                        _ => false,
                    };
                    if name_word {
                        effects.note_custom(custom_name(sql, at));
                    }
                }
                if kind == Word::Execute && executes_by_name(first, words_in_statement, previous) {
                    effects.executes = true;
                }
                match kind {
                    // CREATE [OR REPLACE] [GLOBAL | LOCAL] TEMP[ORARY] ...,
                    // SELECT ... INTO TEMP[ORARY] ...
                    Word::Temp
                        if matches!(
                            previous,
                            Word::Create | Word::Replace | Word::Global | Word::Local | Word::Into
                        ) =>
                    {
                        effects.pins |= PinKinds::TEMP;
                    }
                    // ON COMMIT is for temporary tables only; ON COMMIT DROP
                    // ends it with the transaction: the server is asked.
                    Word::Commit if previous == Word::On => {
                        effects.pins |= PinKinds::TEMP;
                        effects.unpins |= PinKinds::TEMP;
                    }
                    Word::Hold if previous == Word::With && first == Word::Declare => {
                        effects.pins |= PinKinds::HOLD_CURSOR;
                    }
                    // pg_temp.name: an object in the temporary schema.
                    Word::PgTemp if sql.get(end) == Some(&b'.') => effects.pins |= PinKinds::TEMP,
                    Word::SetConfig => {
                        effects.settings = true;
                        effects.note_custom(first_literal_argument(sql, end));
                    }
                    _ => effects.note_function(kind),
                }
                previous = kind;
                at = end;
            }
            _ => at += 1,
        }
    }
    // A lone SET (no second word) is a syntax error: no effect.
    effects
}

impl Effects {
    /// What a statement's first word tells.
    fn note_first(&mut self, first: Word) {
        match first {
            Word::Reset => self.settings = true,
            Word::Discard => {
                // DISCARD ALL / TEMP end state (PLANS, SEQUENCES: nothing
                // that pins; asking costs little).
                self.settings = true;
                self.unpins |= PinKinds::CHECKABLE;
            }
            Word::Do => {
                // The body is not read: it may set, reset or leave anything.
                self.settings = true;
                self.pins |= PinKinds::UNKNOWN;
                self.resets.push(Reset::Unknown);
            }
            Word::Listen => self.pins |= PinKinds::LISTEN,
            Word::Unlisten => self.unpins |= PinKinds::LISTEN,
            Word::Close => self.unpins |= PinKinds::HOLD_CURSOR,
            Word::Deallocate => self.unpins |= PinKinds::SQL_PREPARE,
            Word::Drop => self.unpins |= PinKinds::TEMP,
            Word::Load => self.pins |= PinKinds::LOAD,
            _ => {}
        }
    }

    /// A function named anywhere (a call, most likely).
    fn note_function(&mut self, kind: Word) {
        match kind {
            Word::AdvisoryLock => self.pins |= PinKinds::ADVISORY_LOCK,
            Word::AdvisoryUnlock => self.unpins |= PinKinds::ADVISORY_LOCK,
            _ => {}
        }
    }
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

/// The reset a SET, RESET or DISCARD statement at `at` does, if any:
/// RESET name / ALL, RESET TIME ZONE / SESSION AUTHORIZATION, DISCARD ALL,
/// SET [SESSION | LOCAL] name {TO | =} DEFAULT, SET TIME ZONE {DEFAULT |
/// LOCAL}, SET SESSION AUTHORIZATION DEFAULT, SET NAMES DEFAULT.
fn reset_at(sql: &[u8], at: usize) -> Option<Reset> {
    let mut t = Tokens { sql, at };
    let one = |name: &str, local: bool| {
        Some(Reset::One {
            name: name.to_string(),
            local,
        })
    };
    match t.name()?.as_str() {
        "discard" => t.next_is("all").then_some(Reset::All),
        "reset" => match t.name()?.as_str() {
            "all" => Some(Reset::All),
            "time" if t.next_is("zone") => one("timezone", false),
            "session" if t.next_is("authorization") => one("session_authorization", false),
            name => one(name, false),
        },
        "set" => {
            let mut name = t.name()?;
            let mut local = false;
            if name == "local" || name == "session" && !t.peek_is("authorization") {
                local = name == "local";
                name = t.name()?;
            }
            let name = match name.as_str() {
                "time" if t.next_is("zone") => {
                    return (t.next_is("default") || t.next_is("local")).then(|| Reset::One {
                        name: "timezone".into(),
                        local,
                    });
                }
                "session" if t.next_is("authorization") => "session_authorization".into(),
                "names" => "client_encoding".into(),
                _ => {
                    if !t.next_is("=") && !t.next_is("to") {
                        return None;
                    }
                    name
                }
            };
            t.next_is("default").then_some(Reset::One { name, local })
        }
        _ => None,
    }
}

/// The tokens at the head of a statement, for [`reset_at`]: names
/// (dotted, unquoted parts lower case, quoted ones as written) and single
/// punctuation; whitespace and comments skipped.
struct Tokens<'a> {
    sql: &'a [u8],
    at: usize,
}

impl Tokens<'_> {
    fn skip_space(&mut self) {
        loop {
            match self.sql.get(self.at) {
                Some(b) if b.is_ascii_whitespace() => self.at += 1,
                Some(b'-') if self.sql.get(self.at + 1) == Some(&b'-') => {
                    self.at = skip_line(self.sql, self.at)
                }
                Some(b'/') if self.sql.get(self.at + 1) == Some(&b'*') => {
                    self.at = skip_block_comment(self.sql, self.at)
                }
                _ => return,
            }
        }
    }

    /// One part of a name: a word (lower case) or a quoted identifier.
    fn part(&mut self) -> Option<String> {
        let b = *self.sql.get(self.at)?;
        if b == b'"' {
            let end = skip_quoted(self.sql, self.at, b'"', false);
            let inner = &self.sql[self.at + 1..end.saturating_sub(1).max(self.at + 1)];
            self.at = end;
            Some(String::from_utf8_lossy(inner).replace("\"\"", "\""))
        } else if is_word_start(b) {
            let end = word_end(self.sql, self.at);
            let word = String::from_utf8_lossy(&self.sql[self.at..end]).to_lowercase();
            self.at = end;
            Some(word)
        } else {
            None
        }
    }

    /// The next name (`app.x`, `"DateStyle"`), or `None`.
    fn name(&mut self) -> Option<String> {
        self.skip_space();
        let mut name = self.part()?;
        loop {
            let at = self.at;
            self.skip_space();
            if self.sql.get(self.at) != Some(&b'.') {
                self.at = at;
                return Some(name);
            }
            self.at += 1;
            self.skip_space();
            name.push('.');
            name.push_str(&self.part()?);
        }
    }

    /// Whether the next token is `word` (a lower-case word, or `=`); taken
    /// if so.
    fn next_is(&mut self, word: &str) -> bool {
        self.skip_space();
        let at = self.at;
        let len = if word == "=" {
            usize::from(self.sql.get(at) == Some(&b'='))
        } else if self.sql.get(at).is_some_and(|b| is_word_start(*b))
            && self.sql[at..word_end(self.sql, at)].eq_ignore_ascii_case(word.as_bytes())
        {
            word.len()
        } else {
            0
        };
        self.at += len;
        len > 0
    }

    /// Whether the next token is `word`, without taking it.
    fn peek_is(&mut self, word: &str) -> bool {
        let at = self.at;
        let is = self.next_is(word);
        self.at = at;
        is
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

/// The words the scan looks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Word {
    Set,
    Reset,
    Discard,
    Do,
    Listen,
    Unlisten,
    Create,
    Replace,
    Global,
    Local,
    Into,
    Temp,
    With,
    Hold,
    On,
    Commit,
    Declare,
    Close,
    Prepare,
    Transaction,
    Deallocate,
    Execute,
    Explain,
    As,
    Drop,
    Alter,
    Database,
    Load,
    PgTemp,
    SetConfig,
    /// pg_advisory_lock[_shared], pg_try_advisory_lock[_shared].
    AdvisoryLock,
    /// pg_advisory_unlock[_shared], pg_advisory_unlock_all.
    AdvisoryUnlock,
    Other,
}

/// The words the scan looks for, lower case, and what each is.
const KEYWORDS: [(&[u8], Word); 38] = {
    use Word::*;
    [
        (b"do", Do),
        (b"on", On),
        (b"as", As),
        (b"set", Set),
        (b"into", Into),
        (b"temp", Temp),
        (b"with", With),
        (b"hold", Hold),
        (b"drop", Drop),
        (b"load", Load),
        (b"reset", Reset),
        (b"alter", Alter),
        (b"close", Close),
        (b"local", Local),
        (b"listen", Listen),
        (b"create", Create),
        (b"global", Global),
        (b"commit", Commit),
        (b"discard", Discard),
        (b"replace", Replace),
        (b"declare", Declare),
        (b"prepare", Prepare),
        (b"pg_temp", PgTemp),
        (b"execute", Execute),
        (b"explain", Explain),
        (b"database", Database),
        (b"unlisten", Unlisten),
        (b"temporary", Temp),
        (b"deallocate", Deallocate),
        (b"set_config", SetConfig),
        (b"transaction", Transaction),
        (b"pg_advisory_lock", AdvisoryLock),
        (b"pg_advisory_unlock", AdvisoryUnlock),
        (b"pg_try_advisory_lock", AdvisoryLock),
        (b"pg_advisory_unlock_all", AdvisoryUnlock),
        (b"pg_advisory_lock_shared", AdvisoryLock),
        (b"pg_advisory_unlock_shared", AdvisoryUnlock),
        (b"pg_try_advisory_lock_shared", AdvisoryLock),
    ]
};

/// The longest keyword, plus one.
const KEYWORD_LENGTHS: usize = 28;

/// For each length, the first letters of the keywords that long (bit
/// `letter - 'a'`): most words of a statement (SELECT, FROM, column and
/// table names) are ruled out by one look-up, with no comparison.
const FIRST_LETTERS: [u32; KEYWORD_LENGTHS] = {
    let mut t = [0u32; KEYWORD_LENGTHS];
    let mut i = 0;
    while i < KEYWORDS.len() {
        let name = KEYWORDS[i].0;
        t[name.len()] |= 1 << (name[0] - b'a');
        i += 1;
    }
    t
};

/// For each length, the keywords that long: `KEYWORDS[from..to]`
/// (KEYWORDS is in order of length). A word that passes
/// [`FIRST_LETTERS`] is compared with those only, not with all 38 (a
/// 16-letter table name starting with p, as pgbench's, was compared 38
/// times: ~190 instructions per query).
const BY_LENGTH: [(u8, u8); KEYWORD_LENGTHS] = {
    let mut t = [(0u8, 0u8); KEYWORD_LENGTHS];
    let mut i = 0;
    while i < KEYWORDS.len() {
        let len = KEYWORDS[i].0.len();
        assert!(
            i == 0 || KEYWORDS[i - 1].0.len() <= len,
            "KEYWORDS must be in order of length"
        );
        if t[len].1 == 0 {
            t[len].0 = i as u8;
        }
        t[len].1 = i as u8 + 1;
        i += 1;
    }
    t
};

impl Word {
    /// Which word this is, ignoring case.
    fn of(word: &[u8]) -> Word {
        let first = word.first().map_or(0, u8::to_ascii_lowercase);
        if word.len() >= KEYWORD_LENGTHS
            || !first.is_ascii_lowercase()
            || FIRST_LETTERS[word.len()] & (1 << (first - b'a')) == 0
        {
            return Word::Other;
        }
        let (from, to) = BY_LENGTH[word.len()];
        KEYWORDS[from as usize..to as usize]
            .iter()
            .find(|(name, _)| word.eq_ignore_ascii_case(name))
            .map_or(Word::Other, |(_, kind)| *kind)
    }
}

fn is_word_start(b: u8) -> bool {
    CLASS[b as usize] == WORD_START
}

/// The scan's byte classes: bytes it passes over, bytes that may start a
/// word, and the rest (what may begin a literal, an identifier, a comment
/// or the next statement, and what may continue a word).
const PLAIN: u8 = 0;
const WORD_START: u8 = 1;
const OTHER: u8 = 2;
/// Bytes that may continue a word (letters, digits, `_`, `$`, non-ASCII).
const IN_WORD: [bool; 256] = {
    let mut t = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        t[b] = c.is_ascii_alphanumeric() || c == b'_' || c == b'$' || c >= 0x80;
        b += 1;
    }
    t
};
const CLASS: [u8; 256] = {
    let mut t = [PLAIN; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        t[b] = if c.is_ascii_alphabetic() || c == b'_' || c >= 0x80 {
            WORD_START
        } else if matches!(c, b';' | b'\'' | b'"' | b'-' | b'/' | b'$') {
            OTHER
        } else {
            PLAIN
        };
        b += 1;
    }
    t
};

fn word_end(sql: &[u8], mut at: usize) -> usize {
    while at < sql.len() && IN_WORD[sql[at] as usize] {
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

/// A Query text that is one SQL statement about a named prepared
/// statement, in a shape usher carries in transaction mode (the name is
/// the client's, folded as PostgreSQL folds it; the byte slices are the
/// text around it, without a trailing `;`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SqlPrepared<'a> {
    /// `PREPARE name [(types)] AS statement`: `rest` is what follows the
    /// name.
    Prepare { name: String, rest: &'a [u8] },
    /// `[EXPLAIN [options]] EXECUTE name [(arguments)]`: the text before
    /// and after the name.
    Execute {
        name: String,
        before: &'a [u8],
        after: &'a [u8],
    },
    /// `DEALLOCATE [PREPARE] name` (not `ALL`).
    Deallocate { name: String },
}

/// An `EXECUTE` word (the `words`-th of its statement, after `previous`)
/// that runs a prepared statement by name: `EXECUTE name`, `EXPLAIN ...
/// EXECUTE name`, `CREATE TABLE ... AS EXECUTE name` (not `GRANT EXECUTE`,
/// `EXECUTE FUNCTION` of a trigger: the name that follows must be one the
/// client prepared for it to matter).
fn executes_by_name(first: Word, words: usize, previous: Word) -> bool {
    match first {
        Word::Execute => words == 1,
        Word::Explain => true,
        Word::Create => previous == Word::As,
        _ => false,
    }
}

/// The names of prepared statements a Query text runs by name, in every
/// statement of it ([`executes_by_name`]): (where the name is, the name as
/// PostgreSQL reads it). Names usher does not read are left out.
pub fn execute_references(sql: &[u8]) -> Vec<(std::ops::Range<usize>, String)> {
    let mut found = Vec::new();
    let mut at = 0;
    let mut words = 0;
    let mut first = Word::Other;
    let mut previous = Word::Other;
    while at < sql.len() {
        let b = sql[at];
        match b {
            b';' => {
                words = 0;
                previous = Word::Other;
                at += 1;
            }
            b'\'' => at = skip_quoted(sql, at, b'\'', backslashes_escape(sql, at)),
            b'"' => {
                previous = Word::Other;
                at = skip_quoted(sql, at, b'"', false);
            }
            b'-' if sql.get(at + 1) == Some(&b'-') => at = skip_line(sql, at),
            b'/' if sql.get(at + 1) == Some(&b'*') => at = skip_block_comment(sql, at),
            b'$' if is_dollar_quote_start(sql, at) => at = skip_dollar_quoted(sql, at),
            _ if is_word_start(b) => {
                let end = word_end(sql, at);
                let kind = Word::of(&sql[at..end]);
                words += 1;
                if words == 1 {
                    first = kind;
                }
                at = end;
                if kind == Word::Execute && executes_by_name(first, words, previous) {
                    let start = skip_space(sql, at);
                    if let Some((name, name_end)) = identifier(sql, start) {
                        found.push((start..name_end, name));
                        at = name_end;
                    }
                }
                previous = kind;
            }
            _ => at += 1,
        }
    }
    found
}

/// How many parameters PostgreSQL gives a statement parsed from `sql` with
/// `declared` parameter types: the declared count, or the highest `$n` the
/// text refers to if that is higher (a `$n` in a string, a quoted
/// identifier, a comment or a dollar-quoted body is text, and `a$1` is a
/// name).
pub fn parameter_count(sql: &[u8], declared: usize) -> usize {
    let mut highest = declared;
    let mut at = 0;
    while at < sql.len() {
        match sql[at] {
            b'\'' => at = skip_quoted(sql, at, b'\'', backslashes_escape(sql, at)),
            b'"' => at = skip_quoted(sql, at, b'"', false),
            b'-' if sql.get(at + 1) == Some(&b'-') => at = skip_line(sql, at),
            b'/' if sql.get(at + 1) == Some(&b'*') => at = skip_block_comment(sql, at),
            b'$' if is_dollar_quote_start(sql, at) => at = skip_dollar_quoted(sql, at),
            b'$' => {
                let digits = sql[at + 1..].iter().take_while(|d| d.is_ascii_digit());
                let (mut n, mut len) = (0usize, 0);
                for d in digits {
                    n = n.saturating_mul(10).saturating_add(usize::from(d - b'0'));
                    len += 1;
                }
                highest = highest.max(n);
                at += 1 + len;
            }
            b if is_word_start(b) => at = word_end(sql, at),
            _ => at += 1,
        }
    }
    highest
}

/// Prepared statement names longer than this are truncated by PostgreSQL
/// (NAMEDATALEN - 1): usher does not carry them.
const MAX_NAME: usize = 63;

/// The statement about a prepared statement that `sql` (a Query text)
/// holds alone, if it is one usher carries; `None` for anything else
/// (another statement, several statements, a name usher does not read:
/// `U&"..."`, too long, `ALL`, `PREPARE TRANSACTION`). Cheap for other
/// texts: it looks at the first word and stops.
pub fn prepared_command(sql: &[u8]) -> Option<SqlPrepared<'_>> {
    let mut at = skip_space(sql, 0);
    let (first, end) = keyword(sql, at)?;
    at = end;
    let command = match first {
        Word::Prepare => {
            let (name, name_end) = identifier(sql, skip_space(sql, at))?;
            let after = skip_space(sql, name_end);
            let starts_right = sql.get(after) == Some(&b'(') || keyword_is(sql, after, b"as");
            if !starts_right || name.eq_ignore_ascii_case("transaction") {
                return None;
            }
            let end = statement_end(sql, name_end)?;
            SqlPrepared::Prepare {
                name,
                rest: &sql[name_end..end],
            }
        }
        Word::Execute | Word::Explain => {
            if first == Word::Explain {
                at = skip_space(sql, at);
                if sql.get(at) == Some(&b'(') {
                    at = skip_parenthesised(sql, at)?;
                }
                loop {
                    at = skip_space(sql, at);
                    let (word, end) = word_at(sql, at)?;
                    if word.eq_ignore_ascii_case(b"execute") {
                        at = end;
                        break;
                    }
                    let option = [&b"analyze"[..], b"analyse", b"verbose"]
                        .iter()
                        .any(|w| word.eq_ignore_ascii_case(w));
                    if !option {
                        return None;
                    }
                    at = end;
                }
            }
            let name_start = skip_space(sql, at);
            let (name, name_end) = identifier(sql, name_start)?;
            let end = statement_end(sql, name_end)?;
            let after = skip_space(sql, name_end);
            if after < end && sql[after] != b'(' {
                return None;
            }
            SqlPrepared::Execute {
                name,
                before: &sql[..name_start],
                after: &sql[name_end..end],
            }
        }
        Word::Deallocate => {
            at = skip_space(sql, at);
            if keyword_is(sql, at, b"prepare") {
                at = skip_space(sql, at + "prepare".len());
            }
            if keyword_is(sql, at, b"all") {
                return None;
            }
            let (name, name_end) = identifier(sql, at)?;
            let end = statement_end(sql, name_end)?;
            if skip_space(sql, name_end) < end {
                return None;
            }
            SqlPrepared::Deallocate { name }
        }
        _ => return None,
    };
    Some(command)
}

/// What a text's first statement does to a transaction block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockControl {
    /// BEGIN or START TRANSACTION.
    Begins,
    /// It is one statement that ends the block ([`ends_transaction`]).
    Ends,
}

/// Whether `sql` begins or ends a transaction block (its first word, and
/// for an end the whole text): what the session needs to know should the
/// server die under it (`session/server_lost.rs`).
pub fn block_control(sql: &[u8]) -> Option<BlockControl> {
    let (word, _) = word_at(sql, skip_space(sql, 0))?;
    let is = |w: &[u8]| word.eq_ignore_ascii_case(w);
    if is(b"begin") || is(b"start") {
        Some(BlockControl::Begins)
    } else if (is(b"commit") || is(b"end") || is(b"rollback") || is(b"abort") || is(b"prepare"))
        && ends_transaction(sql)
    {
        Some(BlockControl::Ends)
    } else {
        None
    }
}

/// Whether `sql` is one statement that ends a transaction block, as
/// PostgreSQL's `IsTransactionExitStmt` accepts in an aborted one: COMMIT,
/// END, ROLLBACK or ABORT (with WORK or TRANSACTION, and AND NO CHAIN),
/// or PREPARE TRANSACTION; in an aborted block each answers ROLLBACK.
/// ROLLBACK TO SAVEPOINT and AND CHAIN are not (the block they would go
/// on with is gone). Read when a client's server connection died inside
/// its transaction (`super::lost_block`).
pub fn ends_transaction(sql: &[u8]) -> bool {
    let at = skip_space(sql, 0);
    let Some((word, mut at)) = word_at(sql, at) else {
        return false;
    };
    let exit = [&b"commit"[..], b"end", b"rollback", b"abort"]
        .iter()
        .any(|w| word.eq_ignore_ascii_case(w));
    if exit {
        at = skip_space(sql, at);
        if keyword_is(sql, at, b"work") || keyword_is(sql, at, b"transaction") {
            at = skip_space(sql, word_end(sql, at));
        }
        if keyword_is(sql, at, b"and") {
            at = skip_space(sql, at + 3);
            if !keyword_is(sql, at, b"no") {
                return false;
            }
            at = skip_space(sql, at + 2);
            if !keyword_is(sql, at, b"chain") {
                return false;
            }
            at += "chain".len();
        }
    } else if word.eq_ignore_ascii_case(b"prepare") {
        at = skip_space(sql, at);
        if !keyword_is(sql, at, b"transaction") {
            return false;
        }
        at = skip_space(sql, at + "transaction".len());
        // Its identifier, a string literal.
        if sql.get(at) != Some(&b'\'') {
            return false;
        }
        at = skip_quoted(sql, at, b'\'', false);
    } else {
        return false;
    }
    let at = skip_space(sql, at);
    statement_end(sql, at) == Some(at)
}

/// Past whitespace and comments.
fn skip_space(sql: &[u8], mut at: usize) -> usize {
    loop {
        match sql.get(at) {
            Some(b) if b.is_ascii_whitespace() => at += 1,
            Some(b'-') if sql.get(at + 1) == Some(&b'-') => at = skip_line(sql, at),
            Some(b'/') if sql.get(at + 1) == Some(&b'*') => at = skip_block_comment(sql, at),
            _ => return at,
        }
    }
}

/// The unquoted word at `at` and where it ends.
fn word_at(sql: &[u8], at: usize) -> Option<(&[u8], usize)> {
    if !sql.get(at).is_some_and(|b| is_word_start(*b)) {
        return None;
    }
    let end = word_end(sql, at);
    Some((&sql[at..end], end))
}

fn keyword(sql: &[u8], at: usize) -> Option<(Word, usize)> {
    word_at(sql, at).map(|(w, end)| (Word::of(w), end))
}

/// The unquoted word at `at` is `word` (lower case).
fn keyword_is(sql: &[u8], at: usize, word: &[u8]) -> bool {
    word_at(sql, at).is_some_and(|(w, _)| w.eq_ignore_ascii_case(word))
}

/// A name at `at`, as PostgreSQL reads it: unquoted (ASCII letters folded
/// to lower case) or double-quoted (`""` is a quote); `None` if there is
/// none, it is empty, longer than [`MAX_NAME`] bytes, or not UTF-8.
fn identifier(sql: &[u8], at: usize) -> Option<(String, usize)> {
    let (name, end) = if sql.get(at) == Some(&b'"') {
        let end = skip_quoted(sql, at, b'"', false);
        if end < at + 2 || sql[end - 1] != b'"' {
            return None;
        }
        let inner = &sql[at + 1..end - 1];
        let mut name = Vec::with_capacity(inner.len());
        let mut i = 0;
        while i < inner.len() {
            name.push(inner[i]);
            i += if inner[i] == b'"' { 2 } else { 1 };
        }
        (name, end)
    } else {
        let (word, end) = word_at(sql, at)?;
        if sql.get(end) == Some(&b'&') || sql.get(end) == Some(&b'\'') {
            // U&"..." or a string prefix: not a plain name.
            return None;
        }
        (word.to_ascii_lowercase(), end)
    };
    if name.is_empty() || name.len() > MAX_NAME {
        return None;
    }
    Some((String::from_utf8(name).ok()?, end))
}

/// The database that the DROP DATABASE, ALTER DATABASE or CREATE DATABASE
/// statement at `at` fails on while other sessions are connected to it
/// (55006), as PostgreSQL reads its name: `DROP DATABASE [IF EXISTS]
/// name`, `ALTER DATABASE name RENAME ...` / `SET TABLESPACE ...`, and
/// CREATE DATABASE's template (`TEMPLATE [=] name`, `template1` when
/// none is given or it is DEFAULT). `None` for other statements (ALTER
/// DATABASE name SET param ...) and for names usher does not read.
fn database_target(sql: &[u8], at: usize) -> Option<String> {
    let (first, at) = keyword(sql, at)?;
    let at = skip_space(sql, at);
    if !keyword_is(sql, at, b"database") {
        return None;
    }
    let mut at = skip_space(sql, at + "database".len());
    match first {
        Word::Drop => {
            // A database may be called `if`: IF is a keyword only before
            // EXISTS.
            if keyword_is(sql, at, b"if") {
                let after = skip_space(sql, at + "if".len());
                if keyword_is(sql, after, b"exists") {
                    at = skip_space(sql, after + "exists".len());
                }
            }
            identifier(sql, at).map(|(name, _)| name)
        }
        Word::Alter => {
            let (name, end) = identifier(sql, at)?;
            let at = skip_space(sql, end);
            let moves = keyword_is(sql, at, b"rename")
                || keyword_is(sql, at, b"set")
                    && keyword_is(sql, skip_space(sql, at + "set".len()), b"tablespace");
            moves.then_some(name)
        }
        Word::Create => {
            let (_, end) = identifier(sql, at)?;
            create_database_template(sql, end)
        }
        _ => None,
    }
}

/// The template among CREATE DATABASE's options, which follow `at`:
/// `[WITH] name [=] value ...` (CONNECTION LIMIT is two words); a value
/// is a name, a string, a number or DEFAULT. Without a TEMPLATE option,
/// or with TEMPLATE DEFAULT, PostgreSQL copies `template1`.
fn create_database_template(sql: &[u8], at: usize) -> Option<String> {
    let mut at = skip_space(sql, at);
    if keyword_is(sql, at, b"with") {
        at = skip_space(sql, at + "with".len());
    }
    loop {
        if matches!(sql.get(at), None | Some(b';')) {
            return Some("template1".to_string());
        }
        let (option, end) = word_at(sql, at)?;
        at = skip_space(sql, end);
        if option.eq_ignore_ascii_case(b"connection") {
            if !keyword_is(sql, at, b"limit") {
                return None;
            }
            at = skip_space(sql, at + "limit".len());
        }
        if sql.get(at) == Some(&b'=') {
            at = skip_space(sql, at + 1);
        }
        let (value, end) = option_value(sql, at)?;
        if option.eq_ignore_ascii_case(b"template") {
            return Some(value.unwrap_or_else(|| "template1".to_string()));
        }
        at = skip_space(sql, end);
    }
}

/// A CREATE DATABASE option's value at `at` and where it ends: a name
/// (folded as PostgreSQL folds it) or a string, as written; `None` inside
/// for DEFAULT and numbers. `None` for what usher does not read (E'...'
/// and other prefixed strings).
fn option_value(sql: &[u8], at: usize) -> Option<(Option<String>, usize)> {
    match *sql.get(at)? {
        b'\'' => {
            let end = skip_quoted(sql, at, b'\'', false);
            if end < at + 2 || sql[end - 1] != b'\'' {
                return None;
            }
            let inner = String::from_utf8(sql[at + 1..end - 1].to_vec()).ok()?;
            Some((Some(inner.replace("''", "'")), end))
        }
        b'-' | b'+' | b'.' | b'0'..=b'9' => {
            let end = sql[at + 1..]
                .iter()
                .position(|b| !(b.is_ascii_alphanumeric() || *b == b'.' || *b == b'_'))
                .map_or(sql.len(), |p| at + 1 + p);
            Some((None, end))
        }
        _ => {
            if keyword_is(sql, at, b"default") {
                return Some((None, at + "default".len()));
            }
            identifier(sql, at).map(|(name, end)| (Some(name), end))
        }
    }
}

/// Past a parenthesised group at `at` (strings, quoted names and
/// comments inside are skipped).
fn skip_parenthesised(sql: &[u8], mut at: usize) -> Option<usize> {
    let mut depth = 0usize;
    while at < sql.len() {
        match sql[at] {
            b'(' => {
                depth += 1;
                at += 1;
            }
            b')' => {
                depth -= 1;
                at += 1;
                if depth == 0 {
                    return Some(at);
                }
            }
            b'\'' => at = skip_quoted(sql, at, b'\'', backslashes_escape(sql, at)),
            b'"' => at = skip_quoted(sql, at, b'"', false),
            b'-' if sql.get(at + 1) == Some(&b'-') => at = skip_line(sql, at),
            b'/' if sql.get(at + 1) == Some(&b'*') => at = skip_block_comment(sql, at),
            _ => at += 1,
        }
    }
    None
}

/// Where the statement that continues at `at` ends: at its `;` (or the
/// end of the text), if nothing but whitespace, comments and `;` follow;
/// `None` if another statement does.
fn statement_end(sql: &[u8], mut at: usize) -> Option<usize> {
    while at < sql.len() {
        match sql[at] {
            b';' => break,
            b'\'' => at = skip_quoted(sql, at, b'\'', backslashes_escape(sql, at)),
            b'"' => at = skip_quoted(sql, at, b'"', false),
            b'-' if sql.get(at + 1) == Some(&b'-') => at = skip_line(sql, at),
            b'/' if sql.get(at + 1) == Some(&b'*') => at = skip_block_comment(sql, at),
            b'$' if is_dollar_quote_start(sql, at) => at = skip_dollar_quoted(sql, at),
            _ => at += 1,
        }
    }
    let end = at.min(sql.len());
    let mut rest = end;
    while rest < sql.len() {
        rest = skip_space(sql, rest);
        match sql.get(rest) {
            Some(b';') => rest += 1,
            None => break,
            Some(_) => return None,
        }
    }
    Some(end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_count_is_the_highest_reference_or_the_declared_count() {
        assert_eq!(parameter_count(b"select 1", 0), 0);
        assert_eq!(parameter_count(b"select $1::int4 + $3", 0), 3);
        assert_eq!(parameter_count(b"select $1", 2), 2, "declared types count");
        assert_eq!(parameter_count(b"select $12", 0), 12);
        // Text, not references.
        assert_eq!(
            parameter_count(
                b"select '$5', \"$6\", $$ $7 $$, $t$ $8 $t$, e'\\' $9' -- $10\n",
                0
            ),
            0
        );
        assert_eq!(parameter_count(b"select 1 /* $4 /* $5 */ */ + $2", 0), 2);
        assert_eq!(parameter_count(b"select a$1 from t", 0), 0, "a name");
        assert_eq!(parameter_count(b"select $", 0), 0);
    }

    #[test]
    fn transaction_exits_are_read_as_postgresql_reads_them() {
        for sql in [
            "ROLLBACK",
            "rollback;",
            "  /* c */ COMMIT WORK ; ",
            "end transaction",
            "ABORT AND NO CHAIN",
            "PREPARE TRANSACTION 'gid'",
            "commit;;",
        ] {
            assert!(ends_transaction(sql.as_bytes()), "{sql}");
        }
        for sql in [
            "",
            "SELECT 1",
            "ROLLBACK TO SAVEPOINT a",
            "COMMIT AND CHAIN",
            "ROLLBACK; SELECT 1",
            "commitx",
            "PREPARE TRANSACTION",
            "PREPARE q AS SELECT 1",
            "END LOOP",
        ] {
            assert!(!ends_transaction(sql.as_bytes()), "{sql}");
        }
        assert_eq!(block_control(b" BEGIN"), Some(BlockControl::Begins));
        assert_eq!(
            block_control(b"start transaction read only"),
            Some(BlockControl::Begins)
        );
        assert_eq!(block_control(b"commit"), Some(BlockControl::Ends));
        assert_eq!(block_control(b"commit and chain"), None);
        assert_eq!(block_control(b"select 1"), None);
    }

    fn one(name: &str, local: bool) -> Reset {
        Reset::One {
            name: name.into(),
            local,
        }
    }

    #[test]
    fn resets_are_seen_with_their_names() {
        let resets = |sql: &str| scan(sql.as_bytes()).resets;
        assert_eq!(
            resets("RESET statement_timeout"),
            [one("statement_timeout", false)]
        );
        assert_eq!(resets("reset \"DateStyle\""), [one("DateStyle", false)]);
        assert_eq!(resets("RESET app . x"), [one("app.x", false)]);
        assert_eq!(resets("RESET ALL"), [Reset::All]);
        assert_eq!(resets("discard all"), [Reset::All]);
        assert_eq!(resets("DISCARD PLANS"), []);
        assert_eq!(resets("RESET TIME ZONE"), [one("timezone", false)]);
        assert_eq!(
            resets("RESET SESSION AUTHORIZATION"),
            [one("session_authorization", false)]
        );
        assert_eq!(resets("SET x.y TO DEFAULT"), [one("x.y", false)]);
        assert_eq!(
            resets("set local DateStyle=default"),
            [one("datestyle", true)]
        );
        assert_eq!(
            resets("SET SESSION work_mem = DEFAULT"),
            [one("work_mem", false)]
        );
        assert_eq!(resets("SET TIME ZONE LOCAL"), [one("timezone", false)]);
        assert_eq!(
            resets("SET LOCAL TIME ZONE DEFAULT"),
            [one("timezone", true)]
        );
        assert_eq!(resets("SET TIME ZONE 'UTC'"), []);
        assert_eq!(
            resets("SET SESSION AUTHORIZATION DEFAULT"),
            [one("session_authorization", false)]
        );
        assert_eq!(resets("SET NAMES DEFAULT"), [one("client_encoding", false)]);
        assert_eq!(resets("SET work_mem TO 'default'"), []);
        assert_eq!(resets("SET work_mem TO default_x"), []);
        assert_eq!(
            resets("SET /* c */ work_mem -- c\n TO DEFAULT"),
            [one("work_mem", false)]
        );
        assert_eq!(
            resets("SELECT 1; RESET a; SET b = 1; SET LOCAL c TO DEFAULT; DO $$ $$"),
            [one("a", false), one("c", true), Reset::Unknown]
        );
        assert_eq!(resets("SELECT 'RESET ALL'"), []);
        assert_eq!(Effects::unknown().resets, [Reset::Unknown]);
    }

    #[test]
    fn every_keyword_is_found_in_any_case_and_nothing_else() {
        // The advisory lock functions, written out (the table's length
        // filter must let each through).
        for (name, kind) in [
            ("pg_advisory_lock", Word::AdvisoryLock),
            ("pg_advisory_lock_shared", Word::AdvisoryLock),
            ("pg_try_advisory_lock", Word::AdvisoryLock),
            ("pg_try_advisory_lock_shared", Word::AdvisoryLock),
            ("pg_advisory_unlock", Word::AdvisoryUnlock),
            ("pg_advisory_unlock_shared", Word::AdvisoryUnlock),
            ("pg_advisory_unlock_all", Word::AdvisoryUnlock),
        ] {
            assert_eq!(Word::of(name.as_bytes()), kind, "{name}");
        }
        for (name, kind) in KEYWORDS {
            let upper = name.to_ascii_uppercase();
            assert_eq!(Word::of(name), kind, "{}", String::from_utf8_lossy(name));
            assert_eq!(
                Word::of(&upper),
                kind,
                "{}",
                String::from_utf8_lossy(&upper)
            );
        }
        for other in [
            &b"select"[..],
            b"sets",
            b"pg_advisory_locks",
            b"pgbench_accounts",
            b"d",
            b"",
            b"_do",
            b"\xc3\xa9t\xc3\xa9",
            b"pg_try_advisory_lock_shared_x",
        ] {
            assert_eq!(
                Word::of(other),
                Word::Other,
                "{}",
                String::from_utf8_lossy(other)
            );
        }
    }

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

    fn pins(sql: &str) -> PinKinds {
        scan(sql.as_bytes()).pins
    }

    fn unpins(sql: &str) -> PinKinds {
        scan(sql.as_bytes()).unpins
    }

    #[test]
    fn state_that_cannot_move_is_seen() {
        use PinKinds as K;
        for (sql, kind) in [
            ("LISTEN jobs", K::LISTEN),
            ("  /* hi */ listen \"Jobs\"", K::LISTEN),
            ("select 1; LISTEN a", K::LISTEN),
            ("SELECT pg_advisory_lock(1)", K::ADVISORY_LOCK),
            ("SELECT pg_catalog.pg_advisory_lock(1, 2)", K::ADVISORY_LOCK),
            ("select PG_ADVISORY_LOCK_SHARED(7)", K::ADVISORY_LOCK),
            ("SELECT pg_try_advisory_lock(1)", K::ADVISORY_LOCK),
            ("SELECT pg_try_advisory_lock_shared($1)", K::ADVISORY_LOCK),
            ("SELECT \"pg_advisory_lock\"(1)", K::ADVISORY_LOCK),
            ("CREATE TEMP TABLE t (a int)", K::TEMP),
            ("create temporary table t (a int)", K::TEMP),
            ("CREATE GLOBAL TEMPORARY TABLE t (a int)", K::TEMP),
            ("CREATE LOCAL TEMP SEQUENCE s", K::TEMP),
            ("CREATE OR REPLACE TEMP VIEW v AS SELECT 1", K::TEMP),
            ("CREATE TEMP RECURSIVE VIEW v (n) AS SELECT 1", K::TEMP),
            ("SELECT * INTO TEMP t FROM x", K::TEMP),
            ("SELECT 1 AS a INTO TEMPORARY TABLE t", K::TEMP),
            ("CREATE TABLE pg_temp.t (a int)", K::TEMP),
            (
                "CREATE FUNCTION pg_temp.f() RETURNS int LANGUAGE sql AS 'SELECT 1'",
                K::TEMP,
            ),
            ("CREATE TABLE t (a int) ON COMMIT DELETE ROWS", K::TEMP),
            ("EXPLAIN ANALYZE CREATE TEMP TABLE t AS SELECT 1", K::TEMP),
            ("DECLARE c CURSOR WITH HOLD FOR SELECT 1", K::HOLD_CURSOR),
            (
                "declare c binary no scroll cursor with hold for select 1",
                K::HOLD_CURSOR,
            ),
            ("PREPARE q (int) AS SELECT $1", K::SQL_PREPARE),
            ("prepare q as select 1", K::SQL_PREPARE),
            ("LOAD 'auto_explain'", K::LOAD),
            ("DO $$ BEGIN PERFORM 1; END $$", K::UNKNOWN),
        ] {
            assert_eq!(pins(sql), kind, "{sql}");
        }
        assert_eq!(
            pins("LISTEN a; SELECT pg_advisory_lock(1); CREATE TEMP TABLE t ()"),
            K::LISTEN | K::ADVISORY_LOCK | K::TEMP
        );
    }

    #[test]
    fn statements_that_leave_nothing_do_not_pin() {
        for sql in [
            "SELECT abalance FROM pgbench_accounts WHERE aid = 1",
            "UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = 1",
            "SELECT pg_advisory_xact_lock(1)",
            "SELECT pg_try_advisory_xact_lock_shared(1)",
            "SELECT pg_advisory_unlock_all()",
            "SELECT 'LISTEN x; SELECT pg_advisory_lock(1)'",
            "SELECT $$ CREATE TEMP TABLE t () $$",
            "-- LISTEN x\nSELECT 1",
            "/* DECLARE c CURSOR WITH HOLD FOR SELECT 1 */ SELECT 1",
            "SELECT E'\\'; LISTEN x'",
            "SELECT \"LISTEN\" FROM t",
            "CREATE TABLE t (a int, temp int)",
            "CREATE UNLOGGED TABLE t (a int)",
            "SET temp_buffers = '16MB'",
            "DECLARE c CURSOR WITHOUT HOLD FOR SELECT 1",
            "PREPARE TRANSACTION 'tx1'",
            "EXECUTE q(1)",
            "CREATE FUNCTION f() RETURNS void LANGUAGE plpgsql AS $$ BEGIN LISTEN x; END $$",
            "CREATE FUNCTION f() RETURNS int SET search_path = a, pg_temp LANGUAGE sql AS 'SELECT 1'",
            "SELECT * FROM listen_log",
            "UNLISTEN *",
            "",
        ] {
            assert_eq!(pins(sql), PinKinds::NONE, "{sql}");
        }
    }

    #[test]
    fn statements_that_may_end_the_state_are_seen() {
        use PinKinds as K;
        for (sql, kind) in [
            ("UNLISTEN *", K::LISTEN),
            ("unlisten jobs", K::LISTEN),
            ("SELECT pg_advisory_unlock_all()", K::ADVISORY_LOCK),
            ("SELECT pg_advisory_unlock(1)", K::ADVISORY_LOCK),
            ("SELECT pg_advisory_unlock_shared(1)", K::ADVISORY_LOCK),
            ("DISCARD ALL", K::CHECKABLE),
            ("DISCARD TEMP", K::CHECKABLE),
            ("DROP TABLE t", K::TEMP),
            ("CLOSE ALL", K::HOLD_CURSOR),
            ("close c", K::HOLD_CURSOR),
            ("DEALLOCATE ALL", K::SQL_PREPARE),
            ("DEALLOCATE PREPARE q", K::SQL_PREPARE),
            ("CREATE TEMP TABLE t () ON COMMIT DROP", K::TEMP),
        ] {
            assert_eq!(unpins(sql), kind, "{sql}");
        }
        for sql in [
            "SELECT 1",
            "SELECT 'UNLISTEN *'",
            "-- DISCARD ALL\nSELECT 1",
            "SELECT pg_advisory_xact_lock(1)",
            "LISTEN x",
        ] {
            assert_eq!(unpins(sql), PinKinds::NONE, "{sql}");
        }
    }

    #[test]
    fn pin_kinds_are_named() {
        assert_eq!(
            (PinKinds::LISTEN | PinKinds::TEMP).describe(),
            "LISTEN, a temporary object"
        );
        assert!(PinKinds::CHECKABLE.contains(PinKinds::HOLD_CURSOR));
        assert!(!PinKinds::CHECKABLE.intersects(PinKinds::LOAD | PinKinds::UNKNOWN));
        assert_eq!(
            PinKinds::CHECKABLE
                .without(PinKinds::TEMP)
                .and(PinKinds::TEMP),
            PinKinds::NONE
        );
    }

    fn databases(sql: &str) -> Vec<String> {
        scan(sql.as_bytes()).databases
    }

    #[test]
    fn databases_that_must_have_no_other_session_are_named() {
        for (sql, name) in [
            ("DROP DATABASE x", "x"),
            ("drop database X;", "x"),
            ("DROP DATABASE \"My Db\"", "My Db"),
            ("DROP DATABASE \"a\"\"b\"", "a\"b"),
            ("DROP DATABASE IF EXISTS x", "x"),
            ("DROP DATABASE if exists \"X\" WITH (FORCE)", "X"),
            ("DROP DATABASE x (FORCE)", "x"),
            ("DROP DATABASE if", "if"),
            ("DROP DATABASE \"if\"", "if"),
            ("DROP /* c */ DATABASE -- c\n x", "x"),
            ("  \n DROP\tDATABASE\nx", "x"),
            ("ALTER DATABASE x RENAME TO y", "x"),
            ("alter database \"X\" rename to \"Y\"", "X"),
            ("ALTER DATABASE x SET TABLESPACE t", "x"),
            ("CREATE DATABASE y TEMPLATE x", "x"),
            ("CREATE DATABASE y TEMPLATE = x", "x"),
            ("CREATE DATABASE y TEMPLATE=\"X\"", "X"),
            ("CREATE DATABASE y TEMPLATE 'X'", "X"),
            (
                "create database y with owner = alice encoding 'UTF8' template x",
                "x",
            ),
            (
                "CREATE DATABASE y WITH CONNECTION LIMIT = -1 TEMPLATE x",
                "x",
            ),
            ("CREATE DATABASE y OWNER template TEMPLATE x", "x"),
            (
                "CREATE DATABASE y IS_TEMPLATE true TEMPLATE x STRATEGY file_copy",
                "x",
            ),
            ("CREATE DATABASE y", "template1"),
            ("CREATE DATABASE y OWNER alice;", "template1"),
            ("CREATE DATABASE y TEMPLATE DEFAULT", "template1"),
            ("SELECT 1; DROP DATABASE x", "x"),
        ] {
            assert_eq!(databases(sql), [name], "{sql}");
        }
        assert_eq!(
            databases("DROP DATABASE a; ALTER DATABASE b RENAME TO c; DROP DATABASE a"),
            ["a", "b"]
        );
        for sql in [
            "select 'drop database x'",
            "SELECT 1 -- DROP DATABASE x",
            "/* DROP DATABASE x */ SELECT 1",
            "DO $$ BEGIN DROP DATABASE x; END $$",
            "SELECT $q$ ; DROP DATABASE x $q$",
            "DROP TABLE database",
            "DROP DATABASES x",
            "DROP database_x",
            "CREATE TABLE database (x int)",
            "ALTER DATABASE x SET work_mem = '1MB'",
            "ALTER DATABASE x OWNER TO bob",
            "ALTER DATABASE x RESET ALL",
            "GRANT CONNECT ON DATABASE x TO bob",
            "COMMENT ON DATABASE x IS 'drop database y'",
            "CREATE DATABASE y TEMPLATE E'x'",
            "DROP DATABASE",
            "DROP DATABASE U&\"x\"",
            "SELECT * FROM drop, database",
        ] {
            assert_eq!(databases(sql), Vec::<String>::new(), "{sql}");
        }
        assert!(Effects::unknown().databases.is_empty());
    }

    #[test]
    fn a_message_not_read_whole_may_do_anything() {
        assert!(scan_query(b"SELECT 1").settings, "no NUL: a head only");
        assert!(!scan_query(b"SELECT 1\0").settings);
        assert!(scan_query(b"SET a.b = 1\0").settings);
        assert!(!scan_parse(b"s1\0SELECT 1\0\0\0").settings);
        assert!(scan_parse(b"\0SET a.b = 1\0\0\0").settings);
        assert!(scan_parse(b"\0SELECT 1").settings, "cut text: unknown");
        assert_eq!(scan_query(b"SELECT 1").pins, PinKinds::UNKNOWN);
        assert_eq!(scan_query(b"SELECT 1").unpins, PinKinds::CHECKABLE);
        assert_eq!(scan_parse(b"\0LISTEN x\0\0\0").pins, PinKinds::LISTEN);
    }

    #[test]
    fn statements_about_prepared_statements_are_read() {
        use SqlPrepared as S;
        let name = |n: &str| n.to_string();
        assert_eq!(
            prepared_command(b"PREPARE q (int) AS SELECT $1"),
            Some(S::Prepare {
                name: name("q"),
                rest: b" (int) AS SELECT $1"
            })
        );
        assert_eq!(
            prepared_command(b" /* c */ prepare Foo as select ';' ; -- x\n"),
            Some(S::Prepare {
                name: name("foo"),
                rest: b" as select ';' "
            })
        );
        assert_eq!(
            prepared_command(b"PREPARE \"My \"\"q\"\"\"(text)AS SELECT 1"),
            Some(S::Prepare {
                name: name("My \"q\""),
                rest: b"(text)AS SELECT 1"
            })
        );
        assert_eq!(
            prepared_command(b"EXECUTE q(1, 'a;b')"),
            Some(S::Execute {
                name: name("q"),
                before: b"EXECUTE ",
                after: b"(1, 'a;b')"
            })
        );
        assert_eq!(
            prepared_command(b"execute Q;"),
            Some(S::Execute {
                name: name("q"),
                before: b"execute ",
                after: b""
            })
        );
        assert_eq!(
            prepared_command(b"EXPLAIN (ANALYZE, COSTS OFF) EXECUTE q (2)"),
            Some(S::Execute {
                name: name("q"),
                before: b"EXPLAIN (ANALYZE, COSTS OFF) EXECUTE ",
                after: b" (2)"
            })
        );
        assert_eq!(
            prepared_command(b"explain analyze verbose execute q"),
            Some(S::Execute {
                name: name("q"),
                before: b"explain analyze verbose execute ",
                after: b""
            })
        );
        for (sql, n) in [
            ("DEALLOCATE q", "q"),
            ("deallocate prepare Q;", "q"),
            ("DEALLOCATE \"Q\"", "Q"),
        ] {
            assert_eq!(
                prepared_command(sql.as_bytes()),
                Some(S::Deallocate { name: name(n) }),
                "{sql}"
            );
        }
        for sql in [
            "SELECT 1",
            "PREPARE TRANSACTION 'x'",
            "PREPARE q AS SELECT 1; SELECT 2",
            "PREPARE q",
            "EXECUTE q; EXECUTE q",
            "EXECUTE q x",
            "EXECUTE U&\"q\"",
            "DEALLOCATE ALL",
            "DEALLOCATE PREPARE ALL",
            "DEALLOCATE q, r",
            "DEALLOCATE \"\"",
            "EXPLAIN SELECT 1",
            "EXPLAIN (ANALYZE) SELECT 1",
            "CREATE TABLE t AS EXECUTE q",
            "SELECT 1; DEALLOCATE q",
            "",
        ] {
            assert_eq!(prepared_command(sql.as_bytes()), None, "{sql}");
        }
        let long = format!("DEALLOCATE {}", "x".repeat(64));
        assert_eq!(
            prepared_command(long.as_bytes()),
            None,
            "truncated by the server"
        );
    }

    #[test]
    fn statements_run_by_name_are_found() {
        let names = |sql: &str| -> Vec<(String, String)> {
            execute_references(sql.as_bytes())
                .into_iter()
                .map(|(r, n)| (sql[r].to_string(), n))
                .collect()
        };
        let pair = |a: &str, b: &str| (a.to_string(), b.to_string());
        assert_eq!(names("EXECUTE q(1)"), [pair("q", "q")]);
        assert_eq!(
            names("CREATE TABLE t AS EXECUTE Sel WITH DATA; execute \"X\""),
            [pair("Sel", "sel"), pair("\"X\"", "X")]
        );
        assert_eq!(
            names("EXPLAIN (ANALYZE) CREATE TABLE t AS EXECUTE q"),
            [pair("q", "q")]
        );
        assert_eq!(names("BEGIN; EXECUTE a; COMMIT"), [pair("a", "a")]);
        for sql in [
            "GRANT EXECUTE ON FUNCTION f() TO r",
            "CREATE TRIGGER t AFTER INSERT ON x EXECUTE FUNCTION f()",
            "SELECT 'EXECUTE q'",
            "DO $$ BEGIN EXECUTE 'x'; END $$",
            "SELECT execute FROM t",
        ] {
            assert!(names(sql).is_empty(), "{sql}");
        }
        assert!(scan(b"CREATE TABLE t AS EXECUTE q").executes);
        assert!(scan(b"select 1; EXECUTE q").executes);
        assert!(!scan(b"GRANT EXECUTE ON FUNCTION f() TO r").executes);
    }
}
