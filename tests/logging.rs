//! The log level changes while usher runs (`usher::logging::set_level`, what
//! a configuration reload calls). One test: the subscriber is global to this
//! test binary.

use tracing::Level;

#[test]
fn set_level_changes_the_running_filter() {
    // The only test of this binary: nothing else reads the environment.
    std::env::remove_var("USHER_LOG");
    let config = usher::Config::from_yaml("log: { level: warn }\n", "t.yaml").unwrap();
    usher::logging::init(&config.log);
    assert!(tracing::enabled!(Level::WARN));
    assert!(!tracing::enabled!(Level::INFO));

    usher::logging::set_level("info").unwrap();
    assert!(tracing::enabled!(Level::INFO));
    assert!(!tracing::enabled!(Level::DEBUG));

    // A bad filter is refused and the running one stays.
    let e = usher::logging::set_level("usher=loud").unwrap_err();
    assert!(e.to_string().contains("usher=loud"), "{e}");
    assert!(tracing::enabled!(Level::INFO));

    // Per-target filters work too.
    usher::logging::set_level("error,logging=debug").unwrap();
    assert!(tracing::enabled!(Level::DEBUG));
    assert!(!tracing::enabled!(target: "usher::app", Level::WARN));
    assert!(tracing::enabled!(target: "usher::app", Level::ERROR));
}
