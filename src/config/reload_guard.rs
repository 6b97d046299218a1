//! What a reload may not take away without being told to: a configuration
//! file emptied by accident (a truncated write, a template that rendered
//! nothing) left every login with 28P01 and the console gone, and a
//! `hooks.dir` naming a missing folder dropped every hook, a rejecting one
//! too, with "hook_files=0" at INFO. A reload that would leave no users, no
//! databases or no hook files where the running set has some is refused
//! with an error that says why, and the running set stays.
//! `hooks.allow_empty: true` says "no hook files" on purpose.

use super::{Config, ConfigIssue};

/// What a configuration, with what was loaded from it, provides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Provides {
    /// Some user can be looked up: listed under `users`, in `auth.file`,
    /// or through `auth.query`.
    pub users: bool,
    /// `databases` lists one (the fallback entry `"*"` counts).
    pub databases: bool,
    /// Lua hook files loaded from `hooks.dir`.
    pub hook_files: usize,
}

/// Refuses a reload from `running` to `new` (whose configuration is
/// `config`) that would leave nothing where there was something.
pub fn check(running: &Provides, new: &Provides, config: &Config) -> Result<(), ConfigIssue> {
    let refused = |key: &str, what: &str| {
        ConfigIssue::new(
            key,
            format!(
                "{what}, where the running configuration has some: refused, the running set stays"
            ),
        )
    };
    if running.databases && !new.databases {
        return Err(refused(
            "databases",
            "the new configuration lists no database",
        ));
    }
    if running.users && !new.users {
        return Err(refused(
            "users",
            "the new configuration has no users (none under `users`, in auth.file or through auth.query)",
        ));
    }
    if running.hook_files > 0 && new.hook_files == 0 && !config.hooks.allow_empty {
        let dir = config.hooks.dir.display();
        let found = if config.hooks.dir.is_dir() {
            format!("the folder {dir} holds no hook file")
        } else {
            format!("the folder {dir} does not exist")
        };
        return Err(ConfigIssue::new(
            "hooks.dir",
            format!(
                "{found}, where {} hook file(s) are loaded: refused, the running hooks stay (set hooks.allow_empty: true to run without hook files)",
                running.hook_files
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: Provides = Provides {
        users: true,
        databases: true,
        hook_files: 2,
    };

    fn config(yaml: &str) -> Config {
        Config::from_yaml(yaml, "t.yaml").unwrap()
    }

    #[test]
    fn a_reload_that_leaves_nothing_where_there_was_something_is_refused() {
        let c = config("hooks: { dir: /nonexistent/usher-hooks }\n");
        assert!(check(&ALL, &ALL, &c).is_ok());
        let none = |p: Provides| check(&ALL, &p, &c).unwrap_err();
        let e = none(Provides {
            databases: false,
            ..ALL
        });
        assert_eq!(e.key, "databases");
        let e = none(Provides {
            users: false,
            ..ALL
        });
        assert_eq!(e.key, "users");
        let e = none(Provides {
            hook_files: 0,
            ..ALL
        });
        assert_eq!(e.key, "hooks.dir");
        assert!(e.message.contains("does not exist"), "{}", e.message);
        assert!(e.message.contains("2 hook file(s)"), "{}", e.message);
        // Said on purpose; and nothing before, nothing after is no change.
        let allowed = config("hooks: { dir: /nonexistent/usher-hooks, allow_empty: true }\n");
        let no_hooks = Provides {
            hook_files: 0,
            ..ALL
        };
        assert!(check(&ALL, &no_hooks, &allowed).is_ok());
        let empty = Provides {
            users: false,
            databases: false,
            hook_files: 0,
        };
        assert!(check(&empty, &empty, &c).is_ok());
    }
}
