//! usher's own statements on a client's server connection (reading the
//! session's settings back after a statement that may change them,
//! putting values back after a RESET, bringing a connection in line at
//! checkout) leave nothing the client can see: the client's unnamed
//! statement, which a simple Query or an unnamed Parse would drop, is
//! still its own afterwards, as on a direct connection (issue 26, item 2).

use crate::common::raw::{Msg, RawClient};
use crate::common::wire::Frontend::*;
use crate::common::{PgCluster, UsherProcess};

fn usher(mode: &str) -> UsherProcess {
    UsherProcess::builder(PgCluster::shared())
        .extra(&format!(
            "auth:\n  method: trust\npool_mode: {mode}\npool_size: 1\n"
        ))
        .start()
}

fn s(x: &str) -> String {
    x.to_string()
}

/// The unnamed statement survives a named statement that calls
/// set_config (after which usher reads the settings back), in both modes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unnamed_statement_outlives_the_settings_read_back() {
    for mode in ["session", "transaction"] {
        let usher = usher(mode);
        let (mut c, _) =
            RawClient::tcp(usher.addr(), &[("user", "alice"), ("database", "app")]).await;
        let parsed = c
            .batch(&[Parse(s(""), s("select 'mine'"), vec![]), Sync])
            .await;
        assert_eq!(parsed, [Msg::ParseComplete, Msg::Ready('I')], "{mode}");
        let set = c
            .batch(&[
                Parse(s("s"), s("select set_config('jit', 'off', false)"), vec![]),
                Bind(s(""), s("s"), vec![]),
                Execute(s(""), 0),
                Sync,
            ])
            .await;
        assert!(
            set.contains(&Msg::Row(vec![Some(s("off"))])),
            "{mode}: {set:?}"
        );
        // Directly, the unnamed statement is still `select 'mine'`.
        let used = c
            .batch(&[
                Describe('S', s("")),
                Bind(s(""), s(""), vec![]),
                Execute(s(""), 0),
                Sync,
            ])
            .await;
        assert!(
            used.contains(&Msg::Row(vec![Some(s("mine"))])),
            "{mode}: the client's unnamed statement was not its own after usher's read-back: {used:?}"
        );
        assert!(
            !used.iter().any(|m| matches!(m, Msg::Error(..))),
            "{mode}: {used:?}"
        );
        c.close().await;
    }
}

/// The same after a RESET inside a transaction block, where usher puts the
/// client's values back before the client hears the ReadyForQuery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unnamed_statement_outlives_a_reset_put_back() {
    for mode in ["session", "transaction"] {
        let usher = usher(mode);
        let (mut c, _) = RawClient::tcp(
            usher.addr(),
            &[
                ("user", "alice"),
                ("database", "app"),
                ("application_name", "mine"),
            ],
        )
        .await;
        let begun = c
            .batch(&[
                Query(s("BEGIN")),
                Query(s("SET application_name = 'other'")),
                Parse(
                    s(""),
                    s("select current_setting('application_name')"),
                    vec![],
                ),
                Sync,
            ])
            .await;
        assert!(
            !begun.iter().any(|m| matches!(m, Msg::Error(..))),
            "{mode}: {begun:?}"
        );
        let reset = c
            .batch(&[
                Parse(s("r"), s("RESET application_name"), vec![]),
                Bind(s(""), s("r"), vec![]),
                Execute(s(""), 0),
                Sync,
            ])
            .await;
        assert!(
            !reset.iter().any(|m| matches!(m, Msg::Error(..))),
            "{mode}: {reset:?}"
        );
        let used = c
            .batch(&[
                Bind(s(""), s(""), vec![]),
                Execute(s(""), 0),
                Sync,
                Query(s("COMMIT")),
            ])
            .await;
        assert!(
            used.contains(&Msg::Row(vec![Some(s("mine"))])),
            "{mode}: after the RESET, the client's unnamed statement: {used:?}"
        );
        c.close().await;
    }
}
