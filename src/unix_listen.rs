//! The clients' Unix-domain socket (`unix_socket_dir`):
//! `<dir>/.s.PGSQL.<port>`, the name libpq looks for, so that
//! `psql -h <dir> -p <port>` reaches usher.
//!
//! At start a file already at the path is looked at first. A
//! `.s.PGSQL.<port>.lock` beside it is PostgreSQL's: its socket is not
//! touched (as PgBouncer refuses). A socket nobody listens on (a process
//! that died without removing it) is replaced. A socket another process
//! listens on is an error, unless `so_reuseport` is on: then it is taken
//! over, as the TCP port is shared, for a rolling restart (the old
//! process keeps serving the clients it has, and new ones come here).
//! Anything else at the path is an error.
//!
//! The socket is bound under a temporary name, given its mode and group,
//! then renamed into place: it is never reachable with other permissions,
//! and taking over a live socket leaves no moment without one. usher
//! remembers the file it made (device and inode) and removes it when it
//! stops listening, unless another usher has taken the path over since.
//! A socket usher could not remove (a crash) is stale and replaced at the
//! next start.

use crate::client_addr::LocalPeer;
use crate::config::SocketMode;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use tokio::net::{UnixListener, UnixStream};

/// As the TCP listener's.
const BACKLOG: i32 = 1024;

/// What the socket is made with.
#[derive(Debug, Clone)]
pub struct UnixSocketSettings {
    pub dir: PathBuf,
    /// The port in the socket's name: `listen`'s, as bound.
    pub port: u16,
    pub mode: SocketMode,
    /// A group name or number.
    pub group: Option<String>,
    /// `so_reuseport`: a live socket at the path is taken over.
    pub take_over: bool,
}

/// The listening socket and the file it is reached through.
#[derive(Debug)]
pub struct UnixSocket {
    listener: UnixListener,
    file: SocketFile,
    port: u16,
}

/// The socket file usher made; removed when dropped if the path still
/// names it.
#[derive(Debug)]
struct SocketFile {
    path: PathBuf,
    /// (device, inode) of the file usher made.
    id: (u64, u64),
}

/// `<dir>/.s.PGSQL.<port>`, as libpq names it.
pub fn socket_path(dir: &Path, port: u16) -> PathBuf {
    dir.join(format!(".s.PGSQL.{port}"))
}

/// An error that names the path and says what was wrong.
fn error(kind: io::ErrorKind, path: &Path, what: impl std::fmt::Display) -> io::Error {
    io::Error::new(kind, format!("unix_socket_dir: {}: {what}", path.display()))
}

impl UnixSocket {
    /// Makes the socket (see the module's doc). Must run in a tokio
    /// runtime.
    pub fn bind(settings: &UnixSocketSettings) -> io::Result<UnixSocket> {
        let path = socket_path(&settings.dir, settings.port);
        let lock = path.with_file_name(format!(".s.PGSQL.{}.lock", settings.port));
        if lock.exists() {
            return Err(error(
                io::ErrorKind::AddrInUse,
                &path,
                format!(
                    "{} exists: a PostgreSQL server uses this directory and port; give usher another unix_socket_dir or listen port",
                    lock.display()
                ),
            ));
        }
        match std::fs::symlink_metadata(&path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(error(e.kind(), &path, e)),
            Ok(meta) if !meta.file_type().is_socket() => {
                return Err(error(
                    io::ErrorKind::AlreadyExists,
                    &path,
                    "exists and is not a socket; usher does not remove it",
                ));
            }
            Ok(_) => match std::os::unix::net::UnixStream::connect(&path) {
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    tracing::info!(path = %path.display(), "replacing a stale socket file (nobody listens on it)");
                }
                Err(e) => {
                    return Err(error(
                        e.kind(),
                        &path,
                        format!("cannot tell whether a process listens on it: {e}"),
                    ))
                }
                Ok(_) if settings.take_over => {
                    tracing::info!(path = %path.display(), "taking over the socket of another process (so_reuseport); its clients stay with it");
                }
                Ok(_) => {
                    return Err(error(
                        io::ErrorKind::AddrInUse,
                        &path,
                        "another process listens on it (set so_reuseport: true to take it over in a rolling restart)",
                    ));
                }
            },
        }
        let group = settings.group.as_deref().map(group_id).transpose()?;
        let temporary =
            path.with_file_name(format!(".s.PGSQL.{}.{}", settings.port, std::process::id()));
        let _ = std::fs::remove_file(&temporary);
        let listener = listen(&temporary).map_err(|e| error(e.kind(), &temporary, e))?;
        let placed = (|| {
            std::fs::set_permissions(&temporary, std::fs::Permissions::from_mode(settings.mode.0))?;
            if let Some(gid) = group {
                std::os::unix::fs::chown(&temporary, None, Some(gid))?;
            }
            std::fs::rename(&temporary, &path)?;
            std::fs::symlink_metadata(&path)
        })();
        let meta = match placed {
            Ok(meta) => meta,
            Err(e) => {
                let _ = std::fs::remove_file(&temporary);
                return Err(error(e.kind(), &path, e));
            }
        };
        Ok(UnixSocket {
            listener,
            file: SocketFile {
                path,
                id: (meta.dev(), meta.ino()),
            },
            port: settings.port,
        })
    }

    /// The socket file's path.
    pub fn path(&self) -> &Path {
        &self.file.path
    }

    /// The next client, with its credentials. A connection whose
    /// credentials cannot be read (none on Linux) is closed and skipped.
    pub async fn accept(&self) -> io::Result<(UnixStream, LocalPeer)> {
        loop {
            let (stream, _) = self.listener.accept().await?;
            match peer(&stream, self.port) {
                Ok(peer) => return Ok((stream, peer)),
                Err(e) => {
                    tracing::warn!(error = %e, "no credentials for a Unix socket client; closed")
                }
            }
        }
    }

    /// Stops listening: removes the socket file (if it is still usher's),
    /// so that nobody else connects, then takes the connections already
    /// queued (closing would reset them) and closes. Those are returned to
    /// be served as any other.
    pub fn close(self) -> Vec<(UnixStream, LocalPeer)> {
        let UnixSocket {
            listener,
            file,
            port,
        } = self;
        drop(file);
        let mut queued = Vec::new();
        let Ok(listener) = listener.into_std() else {
            return queued;
        };
        loop {
            match listener.accept() {
                Ok((stream, _)) => {
                    let stream = stream
                        .set_nonblocking(true)
                        .and_then(|()| UnixStream::from_std(stream))
                        .and_then(|s| peer(&s, port).map(|p| (s, p)));
                    match stream {
                        Ok(s) => queued.push(s),
                        Err(e) => {
                            tracing::warn!(error = %e, "a queued connection was lost at shutdown")
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
        queued
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        // Another usher took the path over: the file is its own.
        match std::fs::symlink_metadata(&self.path) {
            Ok(meta) if (meta.dev(), meta.ino()) == self.id => {
                if let Err(e) = std::fs::remove_file(&self.path) {
                    tracing::warn!(path = %self.path.display(), error = %e, "could not remove the socket file");
                }
            }
            _ => {}
        }
    }
}

/// A listening socket at `path`, with [`BACKLOG`].
fn listen(path: &Path) -> io::Result<UnixListener> {
    use socket2::{Domain, SockAddr, Socket, Type};
    let socket = Socket::new(Domain::UNIX, Type::STREAM.cloexec(), None)?;
    socket.bind(&SockAddr::unix(path)?)?;
    socket.listen(BACKLOG)?;
    socket.set_nonblocking(true)?;
    UnixListener::from_std(socket.into())
}

/// The peer's credentials (SO_PEERCRED).
fn peer(stream: &UnixStream, port: u16) -> io::Result<LocalPeer> {
    let cred = stream.peer_cred()?;
    Ok(LocalPeer {
        uid: cred.uid(),
        gid: cred.gid(),
        pid: cred.pid(),
        port,
    })
}

/// The id of a group given by name or number.
fn group_id(group: &str) -> io::Result<u32> {
    if let Ok(gid) = group.parse::<u32>() {
        return Ok(gid);
    }
    let not_found = || {
        io::Error::new(
            io::ErrorKind::NotFound,
            format!("unix_socket_group: no group named `{group}`"),
        )
    };
    let name = std::ffi::CString::new(group).map_err(|_| not_found())?;
    let mut buf = vec![0u8; 1024];
    loop {
        let mut entry: libc::group = unsafe { std::mem::zeroed() };
        let mut found: *mut libc::group = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the call; `buf` outlives it
        // and its length is passed.
        let rc = unsafe {
            libc::getgrnam_r(
                name.as_ptr(),
                &mut entry,
                buf.as_mut_ptr().cast(),
                buf.len(),
                &mut found,
            )
        };
        match rc {
            0 if found.is_null() => return Err(not_found()),
            0 => return Ok(entry.gr_gid),
            libc::ERANGE if buf.len() < 1 << 20 => buf.resize(buf.len() * 2, 0),
            e => return Err(io::Error::from_raw_os_error(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(dir: &Path, take_over: bool) -> UnixSocketSettings {
        UnixSocketSettings {
            dir: dir.to_path_buf(),
            port: 6432,
            mode: SocketMode(0o660),
            group: None,
            take_over,
        }
    }

    #[tokio::test]
    async fn a_stale_socket_is_replaced_and_a_live_one_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = socket_path(dir.path(), 6432);
        // A socket whose process is gone: bound, then its listener dropped.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        let first = UnixSocket::bind(&settings(dir.path(), false)).expect("the stale one replaced");
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o660);
        let e = UnixSocket::bind(&settings(dir.path(), false)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse, "{e}");
        assert!(e.to_string().contains("another process listens"), "{e}");
        drop(first.close());
        assert!(!path.exists(), "removed when usher stops listening");
    }

    #[tokio::test]
    async fn with_so_reuseport_a_live_socket_is_taken_over_and_left_to_the_new_owner() {
        let dir = tempfile::tempdir().unwrap();
        let path = socket_path(dir.path(), 6432);
        let old = UnixSocket::bind(&settings(dir.path(), true)).unwrap();
        let new = UnixSocket::bind(&settings(dir.path(), true)).unwrap();
        // The old one stops: the file is the new one's, and stays.
        drop(old.close());
        assert!(path.exists());
        let client = tokio::net::UnixStream::connect(&path).await.unwrap();
        let (_, peer) = new.accept().await.unwrap();
        assert_eq!(peer.uid, unsafe { libc::geteuid() });
        assert_eq!(peer.pid, Some(std::process::id() as i32));
        drop(client);
        drop(new.close());
        assert!(!path.exists());
    }

    #[tokio::test]
    async fn other_files_and_postgres_sockets_are_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = socket_path(dir.path(), 6432);
        std::fs::write(&path, "not a socket").unwrap();
        let e = UnixSocket::bind(&settings(dir.path(), true)).unwrap_err();
        assert!(e.to_string().contains("is not a socket"), "{e}");
        assert!(path.exists());
        std::fs::remove_file(&path).unwrap();
        std::fs::write(dir.path().join(".s.PGSQL.6432.lock"), "4242\n").unwrap();
        let e = UnixSocket::bind(&settings(dir.path(), true)).unwrap_err();
        assert!(e.to_string().contains("PostgreSQL server"), "{e}");
        assert!(!path.exists());
    }

    #[tokio::test]
    async fn queued_connections_are_taken_before_the_socket_closes() {
        let dir = tempfile::tempdir().unwrap();
        let socket = UnixSocket::bind(&settings(dir.path(), false)).unwrap();
        let path = socket.path().to_path_buf();
        let _clients = [
            std::os::unix::net::UnixStream::connect(&path).unwrap(),
            std::os::unix::net::UnixStream::connect(&path).unwrap(),
        ];
        assert_eq!(socket.close().len(), 2);
        assert!(std::os::unix::net::UnixStream::connect(&path).is_err());
    }

    #[test]
    fn groups_by_name_or_number() {
        assert_eq!(group_id("0").unwrap(), 0);
        assert_eq!(group_id("root").unwrap(), 0);
        let e = group_id("no-such-group-here").unwrap_err();
        assert!(e.to_string().contains("no group named"), "{e}");
    }
}
