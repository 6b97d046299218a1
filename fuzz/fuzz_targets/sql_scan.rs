//! The SQL scanner (`frontend::sql_scan`) reads every Query and Parse text
//! a client sends (what it does to the session, prepared statements run by
//! name, parameter counts, transaction control): arbitrary bytes must never
//! make it panic, loop or point outside the text.
#![no_main]
use libfuzzer_sys::fuzz_target;
use usher::frontend::sql_scan::{self, SqlPrepared};

/// `part` lies within `whole` (a subslice of it).
fn within(whole: &[u8], part: &[u8]) {
    let (start, end) = (whole.as_ptr() as usize, whole.as_ptr() as usize + whole.len());
    let at = part.as_ptr() as usize;
    assert!(
        part.is_empty() || (start <= at && at + part.len() <= end),
        "a slice outside the text"
    );
}

fuzz_target!(|data: &[u8]| {
    let declared = data.first().map_or(0, |b| usize::from(*b));
    let sql = data.get(1..).unwrap_or_default();

    let _ = sql_scan::scan(sql);
    let _ = sql_scan::scan_query(sql);
    let _ = sql_scan::scan_parse(sql);

    let mut last_end = 0;
    for (range, _name) in sql_scan::execute_references(sql) {
        assert!(range.start <= range.end && range.end <= sql.len(), "{range:?}");
        assert!(range.start >= last_end, "references out of order");
        last_end = range.end;
    }

    assert!(sql_scan::parameter_count(sql, declared) >= declared);

    match sql_scan::prepared_command(sql) {
        Some(SqlPrepared::Prepare { rest, .. }) => within(sql, rest),
        Some(SqlPrepared::Execute { before, after, .. }) => {
            within(sql, before);
            within(sql, after);
        }
        _ => {}
    }

    let ends = sql_scan::ends_transaction(sql);
    let control = sql_scan::block_control(sql);
    if ends {
        assert!(control.is_some(), "an end of a block that block_control misses");
    }
});
