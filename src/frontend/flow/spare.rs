//! Flows kept for reuse, a few per worker thread: a transaction-mode
//! client's flow lives for one transaction, and a new one grew its queues
//! from nothing each time. [`Flow::take`] hands out one given back on this
//! thread, reset in place ([`Flow::give_back`] keeps it).

use super::*;

/// Flows at rest given back on this thread ([`Flow::give_back`]), whose
/// queues keep what they allocated: a transaction-mode client's flow lives
/// for one transaction (an idle client holds none), and a new one grew its
/// queues from nothing each time, four allocations and frees per
/// transaction (callgrind, pgbench -S). Bounded per thread, not per client.
const SPARE_PER_THREAD: usize = 32;

thread_local! {
    // Boxed: a flow is handed out and given back as a pointer, never moved.
    #[allow(clippy::vec_box)]
    static SPARE: std::cell::RefCell<Vec<Box<Flow>>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Flow {
    /// A new flow ([`Flow::new`]): one given back on this thread, reset in
    /// its box (its queues emptied, keeping what they allocated), if there
    /// is one. Boxed, so that it moves as a pointer (it is 600 bytes).
    pub fn take(mode: PoolMode, rewriting: bool, pinning: Pinning) -> Box<Self> {
        match SPARE.with(|spare| spare.borrow_mut().pop()) {
            Some(mut flow) => {
                flow.reset(mode, rewriting, pinning);
                flow
            }
            None => Box::new(Flow::new(mode, rewriting, pinning)),
        }
    }

    /// Keeps a flow that is no longer needed for [`Flow::take`] on this
    /// thread (up to [`SPARE_PER_THREAD`]).
    pub fn give_back(self: Box<Self>) {
        SPARE.with(|spare| {
            let mut spare = spare.borrow_mut();
            if spare.len() < SPARE_PER_THREAD {
                spare.push(self);
            }
        });
    }

    /// Makes this flow as [`Flow::new`] would, keeping its queues'
    /// allocations: the queues are emptied, every other field takes its
    /// value from a new flow. Field by field, so that nothing is moved
    /// or dropped whole; the pattern names every field, so a field added
    /// to `Flow` does not compile until it is reset here too.
    fn reset(&mut self, mode: PoolMode, rewriting: bool, pinning: Pinning) {
        let Flow {
            mode,
            rewriting,
            pending,
            unsynced,
            status,
            copy_in,
            discarded,
            server_fatal,
            queries,
            effects,
            resets_from,
            pinning,
            pinned,
            pins_seen,
            unpins_seen,
            slot,
            refuse_next,
            syncs_sent,
            ready_seen,
            copy,
            shape,
            last_shape,
            answered,
            schema_changed,
            ddl_open,
            copy_end,
            last_query,
            begin_segment,
            exit_segment,
            lost,
            plan: _,
            pinning_statements: _,
            refusals: _,
            tracked: _,
            failed_prepares: _,
            closing: _,
        } = Flow::new(mode, rewriting, pinning);
        self.mode = mode;
        self.rewriting = rewriting;
        self.pending = pending;
        self.unsynced = unsynced;
        self.status = status;
        self.copy_in = copy_in;
        self.discarded = discarded;
        self.server_fatal = server_fatal;
        self.queries = queries;
        self.effects = effects;
        self.resets_from = resets_from;
        self.pinning = pinning;
        self.pinned = pinned;
        self.pins_seen = pins_seen;
        self.unpins_seen = unpins_seen;
        self.slot = slot;
        self.refuse_next = refuse_next;
        self.syncs_sent = syncs_sent;
        self.ready_seen = ready_seen;
        self.copy = copy;
        self.shape = shape;
        self.last_shape = last_shape;
        self.answered = answered;
        self.schema_changed = schema_changed;
        self.ddl_open = ddl_open;
        self.copy_end = copy_end;
        self.last_query = last_query;
        self.begin_segment = begin_segment;
        self.exit_segment = exit_segment;
        self.lost = lost;
        self.plan.reset();
        self.pinning_statements.clear();
        self.refusals.clear();
        self.tracked.clear();
        self.failed_prepares.clear();
        self.closing.clear();
    }
}
