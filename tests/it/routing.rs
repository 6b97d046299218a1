//! Tenant routing (issue 30): a client_connection hook sends each client's
//! session to its tenant's shard with `ctx:route{...}`. Two real
//! PostgreSQL clusters are the two shards (the shared one and this
//! module's own); the hook is the cookbook's `tenant-in-user-name.lua`
//! with the shards' ports written in. The clients authenticate as
//! `alice.tenant<N>` against their own `users:` entries (alice's
//! password); the route logs them in to the shard as alice, whose
//! password usher has from its `users:` entry. Shard B has SSL on once a
//! test asks for it (`shard_b_tls`); the other tests do not mind.

use crate::common::console::{console, console_table, get, wait_for_rows};
use crate::common::wait::{wait_for_async, DEADLINE};
use crate::common::{sqlstate, PgCluster, Usher, ALICE_PASSWORD};
use std::path::Path;

const TENANTS: usize = 10;
const CLIENTS: usize = 100;
const ROWS_PER_CLIENT: usize = 5;

fn shard_b() -> &'static PgCluster {
    PgCluster::own(module_path!())
}

/// A database of this module's on a shard, owned by alice, with the rows table.
fn create_shard_database(pg: &PgCluster, name: &str) {
    pg.psql_super(&format!("DROP DATABASE IF EXISTS {name}"));
    pg.psql_super(&format!("CREATE DATABASE {name} OWNER alice"));
    pg.psql_super_db(
        name,
        "CREATE TABLE tenant_rows (tenant int NOT NULL, n int NOT NULL); \
         ALTER TABLE tenant_rows OWNER TO alice",
    );
}

/// The recipe with the two shards' ports and `dbname` written in.
fn hooks_dir(a: u16, b: u16, dbname: &str) -> tempfile::TempDir {
    let recipe =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/cookbook/tenant-in-user-name.lua");
    let code = std::fs::read_to_string(recipe).unwrap();
    let code = code
        .replace("port = 5432", &format!("port = {a}"))
        .replace("port = 5433", &format!("port = {b}"))
        .replace(
            "local dbname = \"tenants\"",
            &format!("local dbname = \"{dbname}\""),
        );
    assert!(
        code.contains(&format!("port = {b}")),
        "the recipe's shards moved"
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tenant-in-user-name.lua"), code).unwrap();
    dir
}

/// usher over shard A's `app`, routing by the recipe; `allowed_ports` in
/// routing.allow.
async fn routing_usher(hooks: &Path, a: u16, allowed_ports: &[u16]) -> Usher {
    routing_usher_with(hooks, a, allowed_ports, "").await
}

/// [`routing_usher`] with more keys of `routing:` (indented by two).
async fn routing_usher_with(hooks: &Path, a: u16, allowed_ports: &[u16], routing: &str) -> Usher {
    let mut users =
        format!("  alice: {{ password: {ALICE_PASSWORD} }}\n  admin: {{ password: admin-pw }}\n");
    for t in 0..TENANTS {
        users.push_str(&format!(
            "  alice.tenant{t}: {{ password: {ALICE_PASSWORD} }}\n"
        ));
    }
    let ports: Vec<String> = allowed_ports.iter().map(u16::to_string).collect();
    Usher::start_yaml(&format!(
        "listen: 127.0.0.1:0\n\
         pool_mode: transaction\n\
         pool_size: 3\n\
         hooks: {{ dir: {} }}\n\
         databases:\n  app: {{ host: 127.0.0.1, port: {a} }}\n\
         users:\n{users}\
         admin: {{ users: [admin] }}\n\
         routing:\n  allow: {{ hosts: [127.0.0.0/8], ports: [{}], databases: [app] }}\n{routing}",
        hooks.display(),
        ports.join(", ")
    ))
    .await
}

async fn tenant_client(
    usher: &Usher,
    tenant: usize,
) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    usher
        .connect_as(&format!("alice.tenant{tenant}"), ALICE_PASSWORD)
        .await
}

/// (tenant, rows) on one shard's database, counted there directly.
fn counts(pg: &PgCluster, db: &str) -> Vec<(usize, usize)> {
    let out = pg.psql_super_db(
        db,
        "SELECT tenant, count(*) FROM tenant_rows GROUP BY tenant ORDER BY tenant",
    );
    out.lines()
        .map(|l| {
            let (t, n) = l.split_once('|').unwrap();
            (t.parse().unwrap(), n.parse().unwrap())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_tenants_rows_land_on_its_shard_and_a_cancel_reaches_it() {
    let (a, b) = (PgCluster::shared(), shard_b());
    let db = "routing_rows";
    create_shard_database(a, db);
    create_shard_database(b, db);
    let hooks = hooks_dir(a.port, b.port, db);
    let usher = routing_usher(hooks.path(), a.port, &[a.port, b.port]).await;

    let mut tasks = Vec::new();
    for i in 0..CLIENTS {
        let tenant = i % TENANTS;
        let client = tenant_client(&usher, tenant)
            .await
            .unwrap_or_else(|e| panic!("tenant {tenant}: {e:?}"));
        tasks.push(tokio::spawn(async move {
            for n in 0..ROWS_PER_CLIENT {
                client
                    .execute(
                        "INSERT INTO tenant_rows VALUES ($1, $2)",
                        &[&(tenant as i32), &(n as i32)],
                    )
                    .await
                    .unwrap_or_else(|e| panic!("tenant {tenant}: {e:?}"));
            }
            // The session is where the route says, as alice.
            let row = client
                .query_one("SELECT current_user::text, current_database()::text", &[])
                .await
                .unwrap();
            (row.get::<_, String>(0), row.get::<_, String>(1))
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), ("alice".to_string(), db.to_string()));
    }
    let per_tenant = CLIENTS / TENANTS * ROWS_PER_CLIENT;
    let even: Vec<_> = (0..TENANTS).step_by(2).map(|t| (t, per_tenant)).collect();
    let odd: Vec<_> = (1..TENANTS).step_by(2).map(|t| (t, per_tenant)).collect();
    assert_eq!(
        counts(a, db),
        even,
        "shard A holds the even tenants' rows only"
    );
    assert_eq!(
        counts(b, db),
        odd,
        "shard B holds the odd tenants' rows only"
    );

    // SHOW POOLS: a pool per tenant, its database value the route; no
    // pool of the database the clients asked for is left.
    let shown = |pg: &PgCluster| format!("app@127.0.0.1:{}/{db}", pg.port);
    let (_, pools) = console_table(&usher, "SHOW POOLS").await;
    for t in 0..TENANTS {
        let shard = if t % 2 == 0 { a } else { b };
        let user = format!("alice.tenant{t}");
        assert!(
            pools.iter().any(|r| r[0] == shown(shard) && r[1] == user),
            "tenant {t}'s routed pool in {pools:?}"
        );
    }
    assert!(!pools.iter().any(|r| r[0] == "app"), "{pools:?}");

    // A cancel request reaches the shard the session was routed to.
    let client = tenant_client(&usher, 7).await.unwrap();
    let token = client.cancel_token();
    let sleeping = tokio::spawn(async move {
        let r = client
            .simple_query("SELECT pg_sleep(60) /* routing cancel */")
            .await;
        r.err().and_then(|e| sqlstate(&e))
    });
    wait_for_async(DEADLINE, "the sleep runs on shard B", || async {
        let n = b.psql_super(
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%/* routing cancel */' AND state = 'active' AND pid <> pg_backend_pid()",
        );
        if n == "1" { Ok(()) } else { Err(n) }
    })
    .await;
    let (_, clients) = console_table(&usher, "SHOW CLIENTS").await;
    assert!(
        clients
            .iter()
            .any(|r| r[1] == "alice.tenant7" && r[2] == shown(b) && r[4] == "active"),
        "{clients:?}"
    );
    token
        .cancel_query(tokio_postgres::NoTls)
        .await
        .expect("cancel sent");
    assert_eq!(
        sleeping.await.unwrap().as_deref(),
        Some("57014"),
        "the query was canceled on its shard"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_outside_routing_allow_is_refused() {
    let (a, b) = (PgCluster::shared(), shard_b());
    // Only shard A's port is allowed: odd tenants' routes name shard B's.
    let hooks = hooks_dir(a.port, b.port, "app");
    let usher = routing_usher(hooks.path(), a.port, &[a.port]).await;
    let Err(e) = tenant_client(&usher, 3).await else {
        panic!("a route outside routing.allow was let in")
    };
    assert_eq!(sqlstate(&e).as_deref(), Some("28000"), "{e:?}");
    assert_eq!(e.as_db_error().unwrap().message(), "route not allowed");
    // An allowed route in the same usher works, as alice on shard A's app.
    let c = tenant_client(&usher, 4).await.expect("an allowed route");
    let user: String = c
        .query_one("SELECT current_user::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(user, "alice");
}

/// The cookbook's routing-table.lua with its ttl at `ttl` seconds.
fn table_hooks_dir(ttl: u32) -> tempfile::TempDir {
    let recipe = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/cookbook/routing-table.lua");
    let code = std::fs::read_to_string(recipe).unwrap();
    assert!(code.contains("local ttl = 30\n"), "the recipe's ttl moved");
    let code = code.replace("local ttl = 30\n", &format!("local ttl = {ttl}\n"));
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("routing-table.lua"), code).unwrap();
    dir
}

/// Database `db` on both shards, the routing table in shard A's (acme on
/// A, globex on B), and usher with the routing-table recipe (its ttl at
/// `ttl` seconds) routing through the `app` entry.
async fn routing_table_usher(db: &str, ttl: u32) -> (Usher, tempfile::TempDir) {
    let (a, b) = (PgCluster::shared(), shard_b());
    create_shard_database(a, db);
    create_shard_database(b, db);
    a.psql_super_db(
        db,
        &format!(
            "CREATE TABLE tenant_shards (tenant text PRIMARY KEY, host text NOT NULL, \
               port int NOT NULL, dbname text NOT NULL); \
             ALTER TABLE tenant_shards OWNER TO alice; \
             INSERT INTO tenant_shards VALUES ('acme', '127.0.0.1', {}, '{db}'), \
                                              ('globex', '127.0.0.1', {}, '{db}')",
            a.port, b.port
        ),
    );
    let hooks = table_hooks_dir(ttl);
    let usher = Usher::start_yaml(&format!(
        "listen: 127.0.0.1:0\n\
         pool_mode: transaction\n\
         hooks: {{ dir: {}, timeout_ms: 10000, query: {{ database: app, user: alice, timeout_ms: 10000 }} }}\n\
         databases:\n  app: {{ host: 127.0.0.1, port: {}, dbname: {db} }}\n\
         users:\n  alice: {{ password: {ALICE_PASSWORD} }}\n  alice.acme: {{ password: {ALICE_PASSWORD} }}\n  alice.globex: {{ password: {ALICE_PASSWORD} }}\n  alice.initech: {{ password: {ALICE_PASSWORD} }}\n  admin: {{ password: admin-pw }}\n\
         admin: {{ users: [admin] }}\n\
         routing:\n  allow: {{ hosts: [127.0.0.1], ports: [{}, {}], databases: [app] }}\n",
        hooks.path().display(),
        a.port,
        a.port,
        b.port
    ))
    .await;
    (usher, hooks)
}

async fn server_port(c: &tokio_postgres::Client) -> Result<i32, tokio_postgres::Error> {
    Ok(c.query_one("SELECT inet_server_port()", &[]).await?.get(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moving_a_tenant_in_the_routing_table_sends_new_sessions_to_its_new_shard() {
    let (a, b) = (PgCluster::shared(), shard_b());
    let db = "routing_table";
    let (usher, _hooks) = routing_table_usher(db, 1).await;
    let connect = |user: &'static str| {
        let usher = &usher;
        async move { usher.connect_as(user, ALICE_PASSWORD).await }
    };
    let acme = connect("alice.acme").await.unwrap();
    let globex = connect("alice.globex").await.unwrap();
    assert_eq!(server_port(&acme).await.unwrap(), i32::from(a.port));
    assert_eq!(server_port(&globex).await.unwrap(), i32::from(b.port));
    let Err(e) = connect("alice.initech").await else {
        panic!("a tenant without a row got in")
    };
    assert_eq!(
        e.as_db_error().unwrap().message(),
        "no such tenant: initech"
    );

    // acme moves to shard B: new sessions go there once the cached row
    // expires; the session already open goes on on shard A, with no error,
    // here in the middle of a transaction.
    acme.batch_execute("BEGIN").await.unwrap();
    let in_transaction = backend_pid(&acme).await;
    a.psql_super_db(
        db,
        &format!(
            "UPDATE tenant_shards SET port = {} WHERE tenant = 'acme'",
            b.port
        ),
    );
    wait_for_async(DEADLINE, "a new acme session on shard B", || async {
        let c = connect("alice.acme").await.map_err(|e| e.to_string())?;
        match server_port(&c).await.map_err(|e| e.to_string())? {
            p if p == i32::from(b.port) => Ok(()),
            p => Err(format!("on port {p}")),
        }
    })
    .await;
    for _ in 0..3 {
        assert_eq!(server_port(&acme).await.unwrap(), i32::from(a.port));
    }
    // RECONNECT app, as the recipe says, while that transaction is open:
    // it finishes on its connection, which is closed when it comes back;
    // the session goes on on shard A (its route's pool), with no error.
    crate::common::console::console(&usher, "RECONNECT app").await;
    assert_eq!(backend_pid(&acme).await, in_transaction);
    acme.batch_execute("COMMIT").await.unwrap();
    assert_ne!(
        backend_pid(&acme).await,
        in_transaction,
        "RECONNECT app replaced the routed pool's connection"
    );
    assert_eq!(server_port(&acme).await.unwrap(), i32::from(a.port));
    let c = connect("alice.acme").await.unwrap();
    assert_eq!(server_port(&c).await.unwrap(), i32::from(b.port));
}

/// The recipe as written (a row cached 30 s): after the UPDATE, RECONNECT
/// app on the console sends the tenant's next session to its new shard at
/// once (`usher.reconnects`), where the cache alone would keep it on the
/// old one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_after_moving_a_tenant_sends_its_next_session_to_the_new_shard() {
    let (a, b) = (PgCluster::shared(), shard_b());
    let db = "routing_table_reconnect";
    let (usher, _hooks) = routing_table_usher(db, 30).await;
    let acme = usher
        .connect_as("alice.acme", ALICE_PASSWORD)
        .await
        .unwrap();
    assert_eq!(server_port(&acme).await.unwrap(), i32::from(a.port));
    a.psql_super_db(
        db,
        &format!(
            "UPDATE tenant_shards SET port = {} WHERE tenant = 'acme'",
            b.port
        ),
    );
    let cached = usher
        .connect_as("alice.acme", ALICE_PASSWORD)
        .await
        .unwrap();
    assert_eq!(
        server_port(&cached).await.unwrap(),
        i32::from(a.port),
        "the row is cached for 30 s"
    );
    crate::common::console::console(&usher, "RECONNECT app").await;
    let moved = usher
        .connect_as("alice.acme", ALICE_PASSWORD)
        .await
        .unwrap();
    assert_eq!(server_port(&moved).await.unwrap(), i32::from(b.port));
    // The sessions already open go on on shard A, with no error.
    for c in [&acme, &cached] {
        assert_eq!(server_port(c).await.unwrap(), i32::from(a.port));
    }
}

#[test]
fn hooks_try_shows_the_route_and_whether_it_is_allowed() {
    let hooks = hooks_dir(5432, 5433, "tenants");
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("usher.yaml");
    std::fs::write(
        &config,
        format!(
            "hooks: {{ dir: {} }}\ndatabases:\n  app: {{ host: 127.0.0.1, port: 5432 }}\n\
             routing:\n  allow: {{ hosts: [127.0.0.1], ports: [5432], databases: [app] }}\n",
            hooks.path().display()
        ),
    )
    .unwrap();
    let try_user = |user: &str| {
        let out = crate::common::usher_cli()
            .args(["--config", config.to_str().unwrap()])
            .args(["hooks", "try", "client_connection", "--user", user])
            .args(["--database", "app"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let text = try_user("alice.tenant2");
    assert!(
        text.contains("route by tenant-in-user-name.lua: app@127.0.0.1:5432/tenants (user alice)"),
        "{text}"
    );
    let text = try_user("alice.tenant3");
    assert!(
        text.contains("route by tenant-in-user-name.lua not allowed (28000): port 5433 is not in routing.allow.ports"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_may_choose_session_mode_and_inherit_the_rest() {
    let pg = PgCluster::shared();
    let db = "routing_session";
    create_shard_database(pg, db);
    let hooks = tempfile::tempdir().unwrap();
    std::fs::write(
        hooks.path().join("10-route.lua"),
        format!(
            "function client_connection(ctx)\n  ctx:route{{ dbname = \"{db}\", pool_mode = \"session\", pool_size = 2 }}\nend\n"
        ),
    )
    .unwrap();
    let usher = Usher::start_yaml(&format!(
        "listen: 127.0.0.1:0\n\
         pool_mode: transaction\n\
         hooks: {{ dir: {} }}\n\
         databases:\n  app: {{ host: 127.0.0.1, port: {} }}\n\
         users:\n  alice: {{ password: {ALICE_PASSWORD} }}\n  admin: {{ password: admin-pw }}\n\
         admin: {{ users: [admin] }}\n\
         routing:\n  allow: {{ databases: [app] }}\n",
        hooks.path().display(),
        pg.port
    ))
    .await;
    let c = usher.alice().await;
    let mut pids = std::collections::BTreeSet::new();
    for i in 0..3 {
        let row = c
            .query_one(
                "SELECT pg_backend_pid(), current_database()::text, $1::int",
                &[&i],
            )
            .await
            .unwrap();
        assert_eq!(row.get::<_, String>(1), db);
        assert_eq!(row.get::<_, i32>(2), i);
        pids.insert(row.get::<_, i32>(0));
    }
    assert_eq!(pids.len(), 1, "{pids:?}");
    // Session mode: the idle client keeps its server connection.
    let (columns, clients) = console_table(&usher, "SHOW CLIENTS").await;
    let link = columns.iter().position(|c| c == "link").unwrap();
    let alice = clients
        .iter()
        .find(|r| r[1] == "alice")
        .unwrap_or_else(|| panic!("{clients:?}"));
    assert_eq!(alice[2], format!("app@127.0.0.1:{}/{db}", pg.port));
    assert!(alice[link].starts_with('s'), "idle, yet linked: {alice:?}");
    let (columns, pools) = console_table(&usher, "SHOW POOLS").await;
    let mode = columns.iter().position(|c| c == "pool_mode").unwrap();
    let shown = format!("app@127.0.0.1:{}/{db}", pg.port);
    let row = pools
        .iter()
        .find(|r| r[0] == shown && r[1] == "alice")
        .unwrap_or_else(|| panic!("{pools:?}"));
    assert_eq!(row[mode], "session");
}

async fn backend_pid(c: &tokio_postgres::Client) -> i32 {
    c.query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routed_pools_are_bounded_and_reconnect_of_their_base_reaches_them() {
    let (a, b) = (PgCluster::shared(), shard_b());
    let db = "routing_bounded";
    create_shard_database(a, db);
    create_shard_database(b, db);
    let hooks = hooks_dir(a.port, b.port, db);
    let usher =
        routing_usher_with(hooks.path(), a.port, &[a.port, b.port], "  max_pools: 1\n").await;

    let c = tenant_client(&usher, 1).await.unwrap();
    // The same route again: its pool, not a new one.
    let again = tenant_client(&usher, 1).await.unwrap();
    let Err(e) = tenant_client(&usher, 3).await else {
        panic!("a second routed pool past routing.max_pools")
    };
    assert_eq!(sqlstate(&e).as_deref(), Some("53300"), "{e:?}");
    drop(again);

    // RECONNECT of the base database's name closes the routed pool's
    // connections too.
    let before = backend_pid(&c).await;
    assert_eq!(
        backend_pid(&c).await,
        before,
        "the idle connection is reused"
    );
    crate::common::console::console(&usher, "RECONNECT app").await;
    assert_ne!(
        backend_pid(&c).await,
        before,
        "RECONNECT app reached the routed pool"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_and_resume_of_the_base_database_reach_its_routed_pools() {
    let (a, b) = (PgCluster::shared(), shard_b());
    let db = "routing_pause";
    create_shard_database(a, db);
    create_shard_database(b, db);
    let hooks = hooks_dir(a.port, b.port, db);
    let usher = routing_usher(hooks.path(), a.port, &[a.port, b.port]).await;
    let c = tenant_client(&usher, 1).await.unwrap();
    assert_eq!(server_port(&c).await.unwrap(), i32::from(b.port));

    // PAUSE app: the routed client's next query waits in its routed pool
    // (on shard B), shown on the console as waiting there.
    console(&usher, "PAUSE app").await;
    let query = tokio::spawn(async move {
        let n: i32 = c.query_one("SELECT 41 + 1", &[]).await?.get(0);
        Ok::<_, tokio_postgres::Error>(n)
    });
    let shown = format!("app@127.0.0.1:{}/{db}", b.port);
    wait_for_rows(&usher, "SHOW POOLS", |rows| {
        rows.iter().any(|r| {
            get(r, "database") == Some(&*shown)
                && get(r, "user") == Some("alice.tenant1")
                && get(r, "cl_waiting") == Some("1")
        })
    })
    .await;
    assert!(
        !query.is_finished(),
        "a routed query ran while app was paused"
    );

    // RESUME app lets it run, on its shard.
    console(&usher, "RESUME app").await;
    assert_eq!(query.await.unwrap().unwrap(), 42);
}

/// usher whose hook routes `<role>.x` to the server role `bob` on the
/// database asked for, with these `users:` (indented by two).
async fn bob_routing_usher(pg: &PgCluster, users: &str) -> (Usher, tempfile::TempDir) {
    let hooks = tempfile::tempdir().unwrap();
    std::fs::write(
        hooks.path().join("10-as-bob.lua"),
        "function client_connection(ctx)\n  if ctx.user:match('%.x$') then ctx:route{ user = 'bob' } end\nend\n",
    )
    .unwrap();
    let usher = Usher::start_yaml(&format!(
        "listen: 127.0.0.1:0\n\
         pool_mode: transaction\n\
         hooks: {{ dir: {} }}\n\
         databases:\n  app: {{ host: 127.0.0.1, port: {} }}\n\
         users:\n{users}\
         routing:\n  allow: {{ databases: [app] }}\n",
        hooks.path().display(),
        pg.port
    ))
    .await;
    (usher, hooks)
}

fn verifier(pg: &PgCluster, role: &str) -> String {
    let v = pg.psql_super(&format!(
        "SELECT rolpassword FROM pg_authid WHERE rolname = '{role}'"
    ));
    assert!(v.starts_with("SCRAM-SHA-256$"), "{role}: {v}");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_to_another_role_passes_scram_through_when_the_secret_is_the_clients() {
    let pg = PgCluster::shared();
    let (bob, alice) = (verifier(pg, "bob"), verifier(pg, "alice"));
    // bob.x's secret is bob's verifier (the server's own): its SCRAM proof
    // lets usher log in as bob. alice.x's is alice's: usher has nothing
    // for bob (only his verifier, which is not the client's).
    let (usher, _hooks) = bob_routing_usher(
        pg,
        &format!(
            "  bob: {{ password: '{bob}' }}\n  bob.x: {{ password: '{bob}' }}\n  alice.x: {{ password: '{alice}' }}\n"
        ),
    )
    .await;
    let c = usher
        .connect_as("bob.x", crate::common::BOB_PASSWORD)
        .await
        .expect("bob.x logs in");
    let user: String = c
        .query_one("SELECT current_user::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(user, "bob", "the session runs as the routed role");

    let refused = async {
        let c = usher.connect_as("alice.x", ALICE_PASSWORD).await?;
        c.simple_query("SELECT 1").await
    }
    .await;
    let e = refused.expect_err("alice's proof is not bob's");
    let db = e.as_db_error().unwrap_or_else(|| panic!("{e:?}"));
    assert_eq!(db.code().code(), "28000", "{db:?}");
    assert!(
        db.message()
            .contains("for user \"bob\", which usher does not have"),
        "{db:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_moves_routed_pools_with_their_base_entry_or_retires_them() {
    let (a, b) = (PgCluster::shared(), shard_b());
    let db = "routing_reload";
    create_shard_database(a, db);
    create_shard_database(b, db);
    // The route names only its dbname: its servers are the base entry's.
    let hooks = tempfile::tempdir().unwrap();
    std::fs::write(
        hooks.path().join("10-route.lua"),
        format!("function client_connection(ctx)\n  ctx:route{{ dbname = \"{db}\" }}\nend\n"),
    )
    .unwrap();
    let yaml = |port: u16, allowed: &str| {
        format!(
            "listen: 127.0.0.1:0\n\
             pool_mode: transaction\n\
             hooks: {{ dir: {} }}\n\
             databases:\n  app: {{ host: 127.0.0.1, port: {port} }}\n  other: {{ host: 127.0.0.1, port: {port} }}\n\
             users:\n  alice: {{ password: {ALICE_PASSWORD} }}\n  admin: {{ password: admin-pw }}\n\
             admin: {{ users: [admin] }}\n\
             routing:\n  allow: {{ databases: [{allowed}] }}\n",
            hooks.path().display()
        )
    };
    let usher = Usher::start_yaml(&yaml(a.port, "app")).await;
    let c = usher.alice().await;
    assert_eq!(server_port(&c).await.unwrap(), i32::from(a.port));

    // app moves to shard B: the open session's next transaction runs
    // there (its pool follows its base entry), and so does a new one's.
    usher.rewrite_config(&yaml(b.port, "app"));
    console(&usher, "RELOAD").await;
    assert_eq!(
        server_port(&c).await.unwrap(),
        i32::from(b.port),
        "the routed pool moved with app"
    );
    let fresh = usher.alice().await;
    assert_eq!(server_port(&fresh).await.unwrap(), i32::from(b.port));
    let (_, pools) = console_table(&usher, "SHOW POOLS").await;
    let on = |port: u16| format!("app@127.0.0.1:{port}/{db}");
    assert!(
        !pools.iter().any(|r| r[0] == on(a.port)),
        "no pool is left under the old route: {pools:?}"
    );
    assert!(pools.iter().any(|r| r[0] == on(b.port)), "{pools:?}");

    // app is no longer a base routes may use: new logins are refused, the
    // open sessions finish on their pool, which SHOW POOLS no longer lists.
    usher.rewrite_config(&yaml(b.port, "other"));
    console(&usher, "RELOAD").await;
    let Err(e) = usher.connect_as("alice", ALICE_PASSWORD).await else {
        panic!("a route no longer allowed was let in")
    };
    assert_eq!(sqlstate(&e).as_deref(), Some("28000"), "{e:?}");
    assert_eq!(server_port(&fresh).await.unwrap(), i32::from(b.port));
    let (_, pools) = console_table(&usher, "SHOW POOLS").await;
    assert!(!pools.iter().any(|r| r[0].starts_with("app@")), "{pools:?}");
}

/// Shard B with SSL on (its certificate names only `localhost`), once, and
/// the file of the CA that signed it.
fn shard_b_tls() -> &'static std::path::PathBuf {
    use crate::common::tls::{write_file, TestCa};
    static CA: std::sync::OnceLock<(tempfile::TempDir, std::path::PathBuf)> =
        std::sync::OnceLock::new();
    &CA.get_or_init(|| {
        let ca = TestCa::new("routing test CA");
        shard_b().enable_tls(&ca.server(&["localhost"]));
        let dir = tempfile::tempdir().unwrap();
        let file = write_file(dir.path(), "ca.pem", &ca.cert_pem);
        (dir, file)
    })
    .1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routed_pool_uses_tls_as_its_base_entry_says() {
    let (a, b) = (PgCluster::shared(), shard_b());
    let ca = shard_b_tls();
    let db = "routing_tls";
    create_shard_database(b, db);
    // alice.name routes to shard B by the name its certificate has,
    // alice.ip by address; the base entry says verify-full.
    let hooks = tempfile::tempdir().unwrap();
    std::fs::write(
        hooks.path().join("10-route.lua"),
        format!(
            "function client_connection(ctx)\n  local how = ctx.user:match('%.(%a+)$')\n  \
             ctx:route{{ host = how == 'name' and 'localhost' or '127.0.0.1', port = {}, dbname = '{db}', user = 'alice' }}\nend\n",
            b.port
        ),
    )
    .unwrap();
    let usher = Usher::start_yaml(&format!(
        "listen: 127.0.0.1:0\n\
         pool_mode: transaction\n\
         hooks: {{ dir: {} }}\n\
         databases:\n  app: {{ host: 127.0.0.1, port: {}, tls: verify-full, tls_ca: {} }}\n\
         users:\n  alice: {{ password: {ALICE_PASSWORD} }}\n  alice.name: {{ password: {ALICE_PASSWORD} }}\n  alice.ip: {{ password: {ALICE_PASSWORD} }}\n\
         routing:\n  allow: {{ hosts: [127.0.0.1, localhost], ports: [{}], databases: [app] }}\n",
        hooks.path().display(),
        a.port,
        ca.display(),
        b.port
    ))
    .await;
    let ssl = |user: &'static str| {
        let usher = &usher;
        async move {
            let c = usher.connect_as(user, ALICE_PASSWORD).await?;
            let row = c
                .query_one(
                    "SELECT ssl, inet_server_port() FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
                    &[],
                )
                .await?;
            Ok::<_, tokio_postgres::Error>((row.get::<_, bool>(0), row.get::<_, i32>(1)))
        }
    };
    assert_eq!(
        ssl("alice.name").await.expect("verify-full to localhost"),
        (true, i32::from(b.port)),
        "the routed session is on shard B over TLS"
    );
    // verify-full checks the route's host against the certificate.
    let e = ssl("alice.ip")
        .await
        .expect_err("127.0.0.1 is not the certificate's name");
    assert_eq!(sqlstate(&e).as_deref(), Some("08006"), "{e:?}");
    assert!(
        e.as_db_error()
            .is_some_and(|d| d.message().contains("certificate")),
        "{e:?}"
    );
}
