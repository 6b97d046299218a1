//! `auth.file`: PgBouncer's userlist.txt. Each line is `"user" "secret"`,
//! where the secret is a plaintext password, an md5 hash or a SCRAM-SHA-256
//! verifier; a `"` inside a field is written `""`. Lines starting with `;`
//! or `#` are comments; fields after the second are ignored.

use super::Secret;
use std::collections::HashMap;

/// A line of a userlist that is not `"user" "secret"`: its number and what
/// is wrong, never the line itself (it may hold a password).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {problem}")]
pub struct UserlistError {
    pub line: usize,
    pub problem: &'static str,
}

/// Parses the text of a userlist. Errors give the line number and never
/// quote the line (it may hold a password).
pub fn parse(text: &str) -> Result<HashMap<String, Secret>, UserlistError> {
    Ok(entries(text)?
        .into_iter()
        .map(|(user, secret)| (user, Secret::parse(&secret)))
        .collect())
}

/// The `(user, secret text)` pairs of a userlist, in file order, before the
/// secrets are recognised (a plaintext one costs a PBKDF2 run).
pub fn entries(text: &str) -> Result<Vec<(String, String)>, UserlistError> {
    let mut users = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with(';') || line.starts_with('#') {
            continue;
        }
        let bad = |problem: &'static str| UserlistError {
            line: i + 1,
            problem,
        };
        let (user, rest) = quoted(line).ok_or_else(|| bad("expected \"user\" \"password\""))?;
        let (secret, _) = quoted(rest.trim_start())
            .ok_or_else(|| bad("expected a quoted password after the user name"))?;
        if user.is_empty() {
            return Err(bad("empty user name"));
        }
        users.push((user, secret));
    }
    Ok(users)
}

/// Reads one `"..."` field from the start of `s`; returns it and the rest.
fn quoted(s: &str) -> Option<(String, &str)> {
    let mut rest = s.strip_prefix('"')?;
    let mut out = String::new();
    loop {
        let end = rest.find('"')?;
        out.push_str(&rest[..end]);
        rest = &rest[end + 1..];
        match rest.strip_prefix('"') {
            Some(after) => {
                out.push('"'); // `""` is a quote inside the field
                rest = after;
            }
            None => return Some((out, rest)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_users_with_every_kind_of_secret() {
        let md5 = postgres_protocol::password::md5(b"pw", "bob");
        let scram = postgres_protocol::password::scram_sha_256(b"pw");
        let text = format!(
            "; comment\n\"alice\" \"a\"\"b\"\n\n\"bob\" \"{md5}\"\n  \"carol\"   \"{scram}\" \"ignored\"\n# another\n"
        );
        let users = parse(&text).unwrap();
        assert_eq!(users.len(), 3);
        assert!(users["alice"].check_cleartext("alice", "a\"b"));
        assert!(matches!(users["bob"], Secret::Md5(_)));
        assert!(users["carol"].check_cleartext("carol", "pw"));
    }

    #[test]
    fn errors_name_the_line_and_never_the_password() {
        let e = parse("\"alice\" \"s3cret\"\nalice s3cret\n").unwrap_err();
        let e = e.to_string();
        assert!(e.starts_with("line 2:"), "{e}");
        assert!(!e.contains("s3cret"));
        let e = parse("\"alice\" \"unterminated\n").unwrap_err();
        assert_eq!(e.line, 1, "{e}");
        assert!(parse("\"\" \"x\"\n").is_err());
    }
}
