//! `peer` authentication, as PostgreSQL's: the kernel says which
//! operating-system user runs the client's process (SO_PEERCRED, read when
//! the Unix-socket connection was accepted); its name must be the
//! database user's, or the HBA rule's user name map ([`super::ident`])
//! must let it log in as that user. Only clients of the Unix-domain socket
//! can use it; any failure is `28000` "Peer authentication failed for
//! user", and the reason goes to the log, as PostgreSQL does.

use super::ident::IdentMap;
use super::{AuthFailure, AuthOutcome, Authenticated};
use crate::protocol::error::{shown_name, sqlstate};
use crate::protocol::PgError;
use std::ffi::CStr;

/// Who the kernel says a Unix-socket client is, and how the rule maps it.
#[derive(Debug, Clone, Copy)]
pub struct PeerIdentity<'a> {
    pub uid: u32,
    /// The uid's user name; `None`: the system knows no name for it.
    pub system_user: Option<&'a str>,
    /// The rule's map (`map=name`) and the maps; `None`: the names must
    /// be equal.
    pub map: Option<(&'a str, &'a IdentMap)>,
}

/// Checks `peer` for `user`. `peer` is `None` for a TCP client, which
/// `peer` always refuses.
pub fn check(
    user: &str,
    known: bool,
    peer: Option<&PeerIdentity<'_>>,
) -> Result<Authenticated, AuthFailure> {
    let failed = |outcome: AuthOutcome, reason: String| {
        tracing::info!(user = %shown_name(user), reason = %reason, "peer authentication failed");
        Err(AuthFailure::new(
            outcome,
            PgError::fatal(
                sqlstate::INVALID_AUTHORIZATION,
                format!(
                    "Peer authentication failed for user \"{}\"",
                    shown_name(user)
                ),
            ),
        ))
    };
    let Some(peer) = peer else {
        return failed(
            AuthOutcome::Refused,
            "peer authentication is only supported on local sockets".into(),
        );
    };
    let Some(system) = peer.system_user else {
        return failed(
            AuthOutcome::Refused,
            format!("could not look up local user ID {}", peer.uid),
        );
    };
    let permitted = match peer.map {
        None => system == user,
        Some((name, maps)) => maps.permits(name, system, user),
    };
    if !permitted {
        let reason = match peer.map {
            None => format!(
                "provided user name ({}) and authenticated user name ({system}) do not match",
                shown_name(user)
            ),
            Some((name, _)) => format!(
                "no match in usermap \"{name}\" for user \"{}\" authenticated as \"{system}\"",
                shown_name(user)
            ),
        };
        return failed(AuthOutcome::WrongPassword, reason);
    }
    if !known {
        // Said as a mismatch is: whether a role exists is not told.
        return failed(
            AuthOutcome::UnknownUser,
            format!("{} is not a user usher knows", shown_name(user)),
        );
    }
    tracing::debug!(user = %shown_name(user), system_user = %system, "peer authentication ok");
    Ok(Authenticated::default())
}

/// The name of user `uid` (getpwuid_r), off the runtime's workers: the
/// lookup may ask a directory service. `None` when it has none.
pub async fn system_user(uid: u32) -> Option<String> {
    match tokio::task::spawn_blocking(move || user_name(uid)).await {
        Ok(Ok(name)) => name,
        Ok(Err(e)) => {
            tracing::warn!(uid, error = %e, "could not look up a local user");
            None
        }
        Err(_) => None,
    }
}

/// getpwuid_r, with a buffer grown as the entry needs.
fn user_name(uid: u32) -> std::io::Result<Option<String>> {
    let mut buf = vec![0u8; 1024];
    loop {
        // SAFETY: `entry` is plain data that getpwuid_r fills; `buf`
        // outlives the call and its length is passed; the name is read
        // from `buf` before it is freed.
        let mut entry: libc::passwd = unsafe { std::mem::zeroed() };
        let mut found: *mut libc::passwd = std::ptr::null_mut();
        let rc = unsafe {
            libc::getpwuid_r(
                uid,
                &mut entry,
                buf.as_mut_ptr().cast(),
                buf.len(),
                &mut found,
            )
        };
        match rc {
            0 if found.is_null() => return Ok(None),
            0 => {
                let name = unsafe { CStr::from_ptr(entry.pw_name) };
                return Ok(Some(name.to_string_lossy().into_owned()));
            }
            libc::ERANGE if buf.len() < 1 << 20 => buf.resize(buf.len() * 2, 0),
            e => return Err(std::io::Error::from_raw_os_error(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(r: Result<Authenticated, AuthFailure>) -> (AuthOutcome, String, String) {
        let f = r.unwrap_err();
        (f.outcome, f.error.code.to_string(), f.error.message)
    }

    #[tokio::test]
    async fn uid_zero_is_root_and_an_unknown_uid_has_no_name() {
        assert_eq!(system_user(0).await.as_deref(), Some("root"));
        assert_eq!(system_user(4_000_000_000).await, None);
    }

    #[test]
    fn the_names_must_match_or_the_map_permit_it() {
        let maps = IdentMap::parse_file("m root alice\n").unwrap();
        let me = |map| PeerIdentity {
            uid: 0,
            system_user: Some("root"),
            map,
        };
        assert!(check("root", true, Some(&me(None))).is_ok());
        let refused = (
            AuthOutcome::WrongPassword,
            "28000".to_string(),
            "Peer authentication failed for user \"alice\"".to_string(),
        );
        assert_eq!(message(check("alice", true, Some(&me(None)))), refused);
        assert!(check("alice", true, Some(&me(Some(("m", &maps))))).is_ok());
        assert_eq!(
            message(check("root", true, Some(&me(Some(("m", &maps)))))).0,
            AuthOutcome::WrongPassword,
            "with a map, the map alone decides"
        );
        assert_eq!(
            message(check("alice", false, Some(&me(Some(("m", &maps)))))).0,
            AuthOutcome::UnknownUser
        );
        let (outcome, code, _) = message(check("root", true, None));
        assert_eq!((outcome, code.as_str()), (AuthOutcome::Refused, "28000"));
        let nameless = PeerIdentity {
            uid: 4_000_000_000,
            system_user: None,
            map: None,
        };
        assert_eq!(
            message(check("root", true, Some(&nameless))).0,
            AuthOutcome::Refused
        );
    }
}
