//! HBA rules: which connections may log in, and with which method. The
//! rules come from `auth.hba` (a YAML list with pg_hba.conf's columns as
//! keys) or `auth.hba_file` (pg_hba.conf's own format), and work as
//! PostgreSQL's: the first rule whose type, database, user and address match
//! decides; no match, or a `reject` rule, refuses the connection (28000).
//!
//! Supported: types host, hostssl, hostnossl (TCP clients) and local
//! (clients of the Unix-domain socket, `unix_socket_dir`); databases `all`, `sameuser`, `replication` (never
//! matches) and names; users `all`, names and `+role` (membership asked of
//! the server through `auth.user`); addresses `all`, CIDR, a single address,
//! or address and netmask in the file format; methods trust, password,
//! md5, scram-sha-256, cert, peer (local rules only, as in PostgreSQL) and
//! reject; the option `map=name` on a peer rule (a map of
//! [`super::ident`]).

use crate::client_addr::ClientHost;
use crate::config::{AuthMethod, ConfigIssue, HbaMethod, HbaRuleConfig, HbaType};
use ipnet::IpNet;
use std::future::Future;
use std::net::IpAddr;

/// What is wrong with a rule: a field of `auth.hba` (then it becomes a
/// [`ConfigIssue`] naming the key) or a line of a file ([`HbaFileError`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuleError {
    /// `what` is "database" or "user".
    #[error("empty {0} name")]
    EmptyName(&'static str),
    #[error("`{0}` is not supported")]
    Unsupported(String),
    #[error("@file lists are not supported")]
    FileList,
    #[error("`+` needs a role name")]
    EmptyRole,
    #[error("expected {expected}, got `{got}`")]
    Expected { expected: &'static str, got: String },
    #[error("invalid netmask `{mask}` for `{address}`")]
    Netmask { mask: String, address: String },
    #[error(
        "expected a CIDR address, an IP address or `all`, got `{0}` (host names are not supported)"
    )]
    NotAnAddress(String),
    #[error("local rules take no address")]
    LocalWithAddress,
    #[error("expected a CIDR address or `all` for host rules")]
    HostWithoutAddress,
    #[error(
        "unsupported method `{0}` (expected trust, password, md5, scram-sha-256, cert, peer or reject)"
    )]
    Method(String),
    /// PostgreSQL's words.
    #[error("peer authentication is only supported on local sockets")]
    PeerNotLocal,
    #[error("map is only supported with the peer method")]
    MapWithoutPeer,
    #[error("empty map name")]
    EmptyMap,
    #[error("unsupported connection type `{0}` (expected host, hostssl, hostnossl or local)")]
    ConnectionType(String),
    #[error("expected one {0}")]
    ExpectedOne(&'static str),
    #[error("end of line before the {0} field")]
    EndOfLine(&'static str),
    #[error("rule options other than map=name are not supported, got `{0}`")]
    Options(String),
    #[error("unterminated quoted string")]
    UnterminatedQuote,
}

/// A line of a pg_hba.conf-format file that is not a rule usher can use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {error}")]
pub struct HbaFileError {
    pub line: usize,
    pub error: RuleError,
}

/// The rules, in order.
#[derive(Debug, Clone, Default)]
pub struct Hba {
    rules: Vec<Rule>,
}

#[derive(Debug, Clone)]
struct Rule {
    /// Where the rule came from, for the log: `auth.hba[2]` or `file:7`.
    origin: String,
    conn_type: HbaType,
    databases: Vec<DatabaseName>,
    users: Vec<UserName>,
    /// `None`: any address.
    address: Option<IpNet>,
    method: HbaMethod,
    /// `map=name` (peer rules): the user name map of `auth.ident`.
    map: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum DatabaseName {
    All,
    SameUser,
    Replication,
    Named(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum UserName {
    All,
    Named(String),
    /// `+role`: members of the role (directly or through other roles).
    MemberOf(String),
}

/// What is known of a connection when the rules are checked.
#[derive(Debug, Clone, Copy)]
pub struct Connection<'a> {
    /// An IP address (IPv4-mapped IPv6 as IPv4), or `Local` for the
    /// Unix-domain socket.
    pub host: ClientHost,
    pub tls: bool,
    pub database: &'a str,
    pub user: &'a str,
}

/// What the rules decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Authenticate with this method. `rule` names the rule; `map` is its
    /// user name map (peer).
    Method {
        method: AuthMethod,
        rule: String,
        map: Option<String>,
    },
    /// A `reject` rule matched.
    Reject { rule: String },
    /// No rule matched.
    NoMatch,
}

/// One token of a rule column: its text and whether it was quoted (a quoted
/// `all` is a name, not the keyword).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Token {
    pub(super) text: String,
    pub(super) quoted: bool,
}

impl Hba {
    /// Compiles `auth.hba`; an error names the key.
    pub fn from_config(rules: &[HbaRuleConfig]) -> Result<Hba, ConfigIssue> {
        let mut out = Vec::with_capacity(rules.len());
        for (i, r) in rules.iter().enumerate() {
            let at = |field: &'static str| {
                move |e: RuleError| {
                    ConfigIssue::new(format!("auth.hba[{i}].{field}"), e.to_string())
                }
            };
            let list = |text: &str| -> Vec<Token> {
                text.split(',')
                    .map(|t| Token {
                        text: t.trim().to_string(),
                        quoted: false,
                    })
                    .collect()
            };
            let databases = databases(&list(&r.database)).map_err(at("database"))?;
            let users = users(&list(&r.user)).map_err(at("user"))?;
            let address = match (r.conn_type, r.address.as_deref()) {
                (HbaType::Local, None) => None,
                (HbaType::Local, Some(_)) => {
                    return Err(at("address")(RuleError::LocalWithAddress))
                }
                (_, None) => return Err(at("address")(RuleError::HostWithoutAddress)),
                (_, Some(a)) => address(a, None).map_err(at("address"))?,
            };
            check_method(r.conn_type, r.method, r.map.as_deref()).map_err(|e| match e {
                RuleError::PeerNotLocal => at("method")(e),
                e => at("map")(e),
            })?;
            out.push(Rule {
                origin: format!("auth.hba[{i}]"),
                conn_type: r.conn_type,
                databases,
                users,
                address,
                method: r.method,
                map: r.map.clone(),
            });
        }
        Ok(Hba { rules: out })
    }

    /// Parses a pg_hba.conf-format file; `name` labels rules in the log.
    /// Errors say the line and what was wrong.
    pub fn parse_file(text: &str, name: &str) -> Result<Hba, HbaFileError> {
        let mut rules = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let bad = |error: RuleError| HbaFileError { line: i + 1, error };
            let fields = fields(line).map_err(bad)?;
            if fields.is_empty() {
                continue;
            }
            let single = |f: &Vec<Token>, what: &'static str| -> Result<String, HbaFileError> {
                match f.as_slice() {
                    [t] => Ok(t.text.clone()),
                    _ => Err(bad(RuleError::ExpectedOne(what))),
                }
            };
            let conn_type = match single(&fields[0], "connection type")?.as_str() {
                "local" => HbaType::Local,
                "host" => HbaType::Host,
                "hostssl" => HbaType::HostSsl,
                "hostnossl" => HbaType::HostNoSsl,
                other => return Err(bad(RuleError::ConnectionType(other.to_string()))),
            };
            let mut rest = fields[1..].iter();
            let mut next = |what: &'static str| rest.next().ok_or(bad(RuleError::EndOfLine(what)));
            let databases = databases(next("database")?).map_err(bad)?;
            let users = users(next("user")?).map_err(bad)?;
            let address = if conn_type == HbaType::Local {
                None
            } else {
                let addr = single(next("address")?, "address")?;
                // An address without a prefix length may be followed by a netmask.
                let mask = if !addr.contains('/') && addr != "all" {
                    let peek = rest.clone().next().and_then(|f| match f.as_slice() {
                        [t] if t.text.parse::<IpAddr>().is_ok() => Some(t.text.clone()),
                        _ => None,
                    });
                    if peek.is_some() {
                        rest.next();
                    }
                    peek
                } else {
                    None
                };
                address(&addr, mask.as_deref()).map_err(bad)?
            };
            let method_field = rest.next().ok_or(bad(RuleError::EndOfLine("method")))?;
            let method = method(&single(method_field, "method")?).map_err(bad)?;
            let mut map = None;
            for option in rest {
                match option.as_slice() {
                    [t] if t.text.starts_with("map=") => map = Some(t.text[4..].to_string()),
                    _ => {
                        let text: Vec<_> = option.iter().map(|t| t.text.as_str()).collect();
                        return Err(bad(RuleError::Options(text.join(","))));
                    }
                }
            }
            check_method(conn_type, method, map.as_deref()).map_err(bad)?;
            rules.push(Rule {
                origin: format!("{name}:{}", i + 1),
                conn_type,
                databases,
                users,
                address,
                method,
                map,
            });
        }
        Ok(Hba { rules })
    }

    /// True if some rule authenticates with `method`.
    pub fn uses(&self, method: HbaMethod) -> bool {
        self.rules.iter().any(|r| r.method == method)
    }

    /// The user name maps the rules name, with where each rule is.
    pub fn maps(&self) -> impl Iterator<Item = (&str, &str)> {
        self.rules
            .iter()
            .filter_map(|r| Some((r.map.as_deref()?, r.origin.as_str())))
    }

    /// True if some rule names a `+role` (membership must be asked of the server).
    pub fn needs_membership(&self) -> bool {
        self.rules
            .iter()
            .any(|r| r.users.iter().any(|u| matches!(u, UserName::MemberOf(_))))
    }

    /// Finds the first rule that matches. `is_member(role)` says whether the
    /// connection's user is a member of `role`; it is asked only for rules
    /// that otherwise match.
    pub async fn decide<F, Fut>(&self, conn: &Connection<'_>, is_member: F) -> Decision
    where
        F: Fn(String) -> Fut,
        Fut: Future<Output = bool>,
    {
        for rule in &self.rules {
            let type_ok = match (rule.conn_type, conn.host) {
                (HbaType::Local, host) => host == ClientHost::Local,
                (_, ClientHost::Local) => false,
                (HbaType::Host, _) => true,
                (HbaType::HostSsl, _) => conn.tls,
                (HbaType::HostNoSsl, _) => !conn.tls,
            };
            let address_ok = match (rule.address, conn.host) {
                (Some(net), ClientHost::Ip(ip)) => net.contains(&ip.to_canonical()),
                _ => true,
            };
            if !type_ok
                || !address_ok
                || !rule.databases.iter().any(|d| match d {
                    DatabaseName::All => true,
                    DatabaseName::SameUser => conn.database == conn.user,
                    DatabaseName::Replication => false,
                    DatabaseName::Named(n) => n == conn.database,
                })
            {
                continue;
            }
            let mut user_ok = false;
            for u in &rule.users {
                user_ok = match u {
                    UserName::All => true,
                    UserName::Named(n) => n == conn.user,
                    UserName::MemberOf(role) => is_member(role.clone()).await,
                };
                if user_ok {
                    break;
                }
            }
            if !user_ok {
                continue;
            }
            let rule_name = rule.origin.clone();
            return match rule.method.auth_method() {
                Some(method) => Decision::Method {
                    method,
                    rule: rule_name,
                    map: rule.map.clone(),
                },
                None => Decision::Reject { rule: rule_name },
            };
        }
        Decision::NoMatch
    }
}

fn databases(tokens: &[Token]) -> Result<Vec<DatabaseName>, RuleError> {
    tokens
        .iter()
        .map(|t| match (t.text.as_str(), t.quoted) {
            ("", _) => Err(RuleError::EmptyName("database")),
            ("all", false) => Ok(DatabaseName::All),
            ("sameuser", false) => Ok(DatabaseName::SameUser),
            ("replication", false) => Ok(DatabaseName::Replication),
            ("samerole" | "samegroup", false) => Err(RuleError::Unsupported(t.text.clone())),
            (n, false) if n.starts_with('@') => Err(RuleError::FileList),
            (n, _) => Ok(DatabaseName::Named(n.to_string())),
        })
        .collect()
}

fn users(tokens: &[Token]) -> Result<Vec<UserName>, RuleError> {
    tokens
        .iter()
        .map(|t| match (t.text.as_str(), t.quoted) {
            ("", _) => Err(RuleError::EmptyName("user")),
            ("all", false) => Ok(UserName::All),
            (n, false) if n.starts_with('@') => Err(RuleError::FileList),
            (n, false) if n.starts_with('+') => match &n[1..] {
                "" => Err(RuleError::EmptyRole),
                role => Ok(UserName::MemberOf(role.to_string())),
            },
            (n, _) => Ok(UserName::Named(n.to_string())),
        })
        .collect()
}

fn address(text: &str, netmask: Option<&str>) -> Result<Option<IpNet>, RuleError> {
    let text = text.trim();
    match text {
        "all" => return Ok(None),
        "samehost" | "samenet" => return Err(RuleError::Unsupported(text.to_string())),
        _ => {}
    }
    let expected = |expected: &'static str, got: &str| RuleError::Expected {
        expected,
        got: got.to_string(),
    };
    if let Some(mask) = netmask {
        let ip: IpAddr = text.parse().map_err(|_| expected("an IP address", text))?;
        let mask: IpAddr = mask.parse().map_err(|_| expected("a netmask", mask))?;
        return IpNet::with_netmask(ip, mask)
            .map(Some)
            .map_err(|_| RuleError::Netmask {
                mask: mask.to_string(),
                address: text.to_string(),
            });
    }
    if text.contains('/') {
        let net: IpNet = text
            .parse()
            .map_err(|_| expected("a CIDR address such as 10.0.0.0/8", text))?;
        return Ok(Some(net.trunc()));
    }
    let ip: IpAddr = text
        .parse()
        .map_err(|_| RuleError::NotAnAddress(text.to_string()))?;
    Ok(Some(IpNet::from(ip)))
}

/// Peer only on local rules (as PostgreSQL checks when it loads
/// pg_hba.conf); a map only with peer, and named.
fn check_method(conn_type: HbaType, method: HbaMethod, map: Option<&str>) -> Result<(), RuleError> {
    if method == HbaMethod::Peer && conn_type != HbaType::Local {
        return Err(RuleError::PeerNotLocal);
    }
    match map {
        Some(_) if method != HbaMethod::Peer => Err(RuleError::MapWithoutPeer),
        Some("") => Err(RuleError::EmptyMap),
        _ => Ok(()),
    }
}

fn method(text: &str) -> Result<HbaMethod, RuleError> {
    Ok(match text {
        "trust" => HbaMethod::Trust,
        "password" => HbaMethod::Password,
        "md5" => HbaMethod::Md5,
        "scram-sha-256" => HbaMethod::ScramSha256,
        "cert" => HbaMethod::Cert,
        "peer" => HbaMethod::Peer,
        "reject" => HbaMethod::Reject,
        other => return Err(RuleError::Method(other.to_string())),
    })
}

/// Splits a pg_hba.conf line into fields (whitespace-separated), each a
/// comma-separated list of tokens; `"..."` quotes, `#` starts a comment.
pub(super) fn fields(line: &str) -> Result<Vec<Vec<Token>>, RuleError> {
    let mut fields: Vec<Vec<Token>> = Vec::new();
    let mut field: Vec<Token> = Vec::new();
    let mut token = Token {
        text: String::new(),
        quoted: false,
    };
    let mut in_token = false;
    let mut in_quotes = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if in_quotes {
            match c {
                '"' if chars.peek() == Some(&'"') => {
                    chars.next();
                    token.text.push('"');
                }
                '"' => in_quotes = false,
                c => token.text.push(c),
            }
            continue;
        }
        match c {
            '#' => break,
            '"' => {
                in_quotes = true;
                in_token = true;
                token.quoted = true;
            }
            ',' => {
                field.push(std::mem::replace(
                    &mut token,
                    Token {
                        text: String::new(),
                        quoted: false,
                    },
                ));
                in_token = true; // a list goes on after a comma
            }
            c if c.is_whitespace() => {
                if in_token {
                    field.push(std::mem::replace(
                        &mut token,
                        Token {
                            text: String::new(),
                            quoted: false,
                        },
                    ));
                    fields.push(std::mem::take(&mut field));
                    in_token = false;
                }
            }
            c => {
                in_token = true;
                token.text.push(c);
            }
        }
    }
    if in_quotes {
        return Err(RuleError::UnterminatedQuote);
    }
    if in_token {
        field.push(token);
        fields.push(field);
    }
    Ok(fields)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn<'a>(addr: &str, tls: bool, database: &'a str, user: &'a str) -> Connection<'a> {
        Connection {
            host: addr.parse().unwrap(),
            tls,
            database,
            user,
        }
    }

    /// dana is the only member of staff.
    async fn decide(hba: &Hba, c: Connection<'_>) -> Decision {
        let user = c.user.to_string();
        hba.decide(&c, |role| {
            let member = role == "staff" && user == "dana";
            async move { member }
        })
        .await
    }

    fn method_of(d: Decision) -> Option<AuthMethod> {
        match d {
            Decision::Method { method, .. } => Some(method),
            _ => None,
        }
    }

    #[tokio::test]
    async fn first_matching_rule_wins() {
        let hba = Hba::parse_file(
            "# comment\n\
             hostssl all carol 0.0.0.0/0 reject\n\
             host app alice,bob 127.0.0.1/32 trust   # inline comment\n\
             host all +staff 10.0.0.0 255.0.0.0 md5\n\
             hostnossl sameuser all ::1/128 password\n\
             host all all all scram-sha-256\n",
            "hba.conf",
        )
        .unwrap();
        assert_eq!(
            decide(&hba, conn("127.0.0.1", true, "app", "carol")).await,
            Decision::Reject {
                rule: "hba.conf:2".into()
            }
        );
        assert_eq!(
            method_of(decide(&hba, conn("127.0.0.1", false, "app", "carol")).await),
            Some(AuthMethod::ScramSha256)
        );
        assert_eq!(
            method_of(decide(&hba, conn("127.0.0.1", false, "app", "bob")).await),
            Some(AuthMethod::Trust)
        );
        assert_eq!(
            method_of(decide(&hba, conn("10.1.2.3", false, "db", "dana")).await),
            Some(AuthMethod::Md5),
            "+staff matches its members"
        );
        assert_eq!(
            method_of(decide(&hba, conn("10.1.2.3", false, "db", "other")).await),
            Some(AuthMethod::ScramSha256)
        );
        assert_eq!(
            method_of(decide(&hba, conn("::1", false, "eve", "eve")).await),
            Some(AuthMethod::Password)
        );
        assert_eq!(
            method_of(decide(&hba, conn("::1", true, "eve", "eve")).await),
            Some(AuthMethod::ScramSha256),
            "hostnossl does not match TLS"
        );
    }

    #[tokio::test]
    async fn no_match_and_mapped_addresses() {
        let rules: Vec<HbaRuleConfig> = serde_yaml::from_str(
            "- { type: host, database: app, user: alice, address: 127.0.0.0/8, method: trust }\n\
             - { type: local, database: all, user: all, method: trust }\n",
        )
        .unwrap();
        let hba = Hba::from_config(&rules).unwrap();
        assert_eq!(
            method_of(decide(&hba, conn("::ffff:127.0.0.5", false, "app", "alice")).await),
            Some(AuthMethod::Trust),
            "IPv4-mapped IPv6 addresses match IPv4 rules"
        );
        assert_eq!(
            decide(&hba, conn("192.168.1.1", false, "app", "alice")).await,
            Decision::NoMatch
        );
        assert_eq!(
            decide(&hba, conn("127.0.0.1", false, "other", "alice")).await,
            Decision::NoMatch,
            "local rules never match a TCP connection"
        );
        assert_eq!(
            method_of(decide(&hba, conn("[local]", false, "other", "alice")).await),
            Some(AuthMethod::Trust),
            "local rules match the Unix socket's clients"
        );
        let hosts = Hba::parse_file(
            "host all all all trust
",
            "f",
        )
        .unwrap();
        assert_eq!(
            decide(&hosts, conn("[local]", false, "app", "alice")).await,
            Decision::NoMatch,
            "`host ... all` is every address, not the Unix socket"
        );
    }

    #[test]
    fn quoted_keywords_are_names() {
        let hba = Hba::parse_file("host \"all\" \"a b\",\"x\"\"y\" all trust\n", "f").unwrap();
        let rule = &hba.rules[0];
        assert_eq!(rule.databases, vec![DatabaseName::Named("all".into())]);
        assert_eq!(
            rule.users,
            vec![
                UserName::Named("a b".into()),
                UserName::Named("x\"y".into())
            ]
        );
    }

    #[test]
    fn errors_name_the_line_or_key() {
        for (text, expected) in [
            (
                "host all all 10.0.0.0/8 ldap\n",
                "line 1: unsupported method `ldap`",
            ),
            (
                "\n\nhost all all db.example.com trust\n",
                "line 3: expected a CIDR",
            ),
            (
                "host all all 10.0.0.0/8 md5 clientcert=verify-full\n",
                "line 1: rule options",
            ),
            (
                "host all all 10.0.0.0/8 peer\n",
                "line 1: peer authentication is only supported on local sockets",
            ),
            (
                "local all all md5 map=x\n",
                "line 1: map is only supported with the peer method",
            ),
            (
                "hostgssenc all all all trust\n",
                "line 1: unsupported connection type",
            ),
            ("host all\n", "line 1: end of line before the user field"),
            ("host \"all all all trust\n", "line 1: unterminated"),
            (
                "host all all samenet trust\n",
                "line 1: `samenet` is not supported",
            ),
        ] {
            let e = Hba::parse_file(text, "f").unwrap_err().to_string();
            assert!(e.starts_with(expected), "{text:?}: {e}");
        }
        let rules: Vec<HbaRuleConfig> = serde_yaml::from_str(
            "- { type: host, database: all, user: all, address: 300.0.0.0/8, method: trust }\n",
        )
        .unwrap();
        let issue = Hba::from_config(&rules).unwrap_err();
        assert_eq!(issue.key, "auth.hba[0].address");
        let rules: Vec<HbaRuleConfig> =
            serde_yaml::from_str("- { type: host, database: all, user: all, method: trust }\n")
                .unwrap();
        assert_eq!(
            Hba::from_config(&rules).unwrap_err().key,
            "auth.hba[0].address"
        );
    }

    #[tokio::test]
    async fn peer_rules_are_local_and_carry_their_map() {
        let hba = Hba::parse_file(
            "local app alice peer map=local\nlocal all all peer\nhost all all all md5\n",
            "f",
        )
        .unwrap();
        assert_eq!(
            decide(&hba, conn("[local]", false, "app", "alice")).await,
            Decision::Method {
                method: AuthMethod::Peer,
                rule: "f:1".into(),
                map: Some("local".into())
            }
        );
        assert_eq!(
            decide(&hba, conn("[local]", false, "other", "bob")).await,
            Decision::Method {
                method: AuthMethod::Peer,
                rule: "f:2".into(),
                map: None
            }
        );
        assert_eq!(hba.maps().collect::<Vec<_>>(), [("local", "f:1")]);
        let rules: Vec<HbaRuleConfig> = serde_yaml::from_str(
            "- { type: local, database: all, user: all, method: peer, map: m }\n",
        )
        .unwrap();
        assert_eq!(Hba::from_config(&rules).unwrap().maps().count(), 1);
        for (yaml, key, message) in [
            (
                "- { type: host, database: all, user: all, address: all, method: peer }\n",
                "auth.hba[0].method",
                "peer authentication is only supported on local sockets",
            ),
            (
                "- { type: local, database: all, user: all, method: trust, map: m }\n",
                "auth.hba[0].map",
                "map is only supported with the peer method",
            ),
        ] {
            let rules: Vec<HbaRuleConfig> = serde_yaml::from_str(yaml).unwrap();
            let issue = Hba::from_config(&rules).unwrap_err();
            assert_eq!((issue.key.as_str(), issue.message.as_str()), (key, message));
        }
    }

    #[test]
    fn membership_rules_are_noticed() {
        let hba = Hba::parse_file("host all +ops all trust\n", "f").unwrap();
        assert!(hba.needs_membership());
        let hba = Hba::parse_file("host all ops all trust\n", "f").unwrap();
        assert!(!hba.needs_membership());
    }
}
