//! FrameWalker: a stream walked in arbitrary pieces must give the same
//! messages, the same bodies and the same verdict as walked whole.
#![no_main]
use libfuzzer_sys::fuzz_target;
use usher::protocol::frames::{FrameWalker, Visit};
use usher_fuzz::Input;

#[derive(Debug, PartialEq)]
enum Event {
    Message(u8, Vec<u8>),
    Error(String),
}

struct Setup {
    max_message: usize,
    max_inspected: usize,
    /// Bit n set: bodies of tags with `tag % 8 == n` are asked for whole.
    wanted: u8,
    /// Bit n set: stop after messages with `tag % 8 == n`.
    stop_after: u8,
}

impl Setup {
    fn wants(&self, tag: u8, len: usize) -> bool {
        self.wanted & (1 << (tag % 8)) != 0 && len < 3000
    }
}

/// Walks `pieces` one after another as reads from a socket would arrive,
/// keeping what may not be forwarded yet, and records what was seen.
fn walk(setup: &Setup, pieces: &[&[u8]]) -> (Vec<Event>, usize) {
    let mut walker = FrameWalker::new(setup.max_message).inspect_up_to(setup.max_inspected);
    let mut buf: Vec<u8> = Vec::new();
    let mut events = Vec::new();
    let mut forwarded = 0;
    for piece in pieces {
        buf.extend_from_slice(piece);
        loop {
            let before = buf.len();
            let result = walker.walk(
                &buf,
                |tag, len| setup.wants(tag, len),
                |tag, body| {
                    events.push(Event::Message(tag, body.to_vec()));
                    if setup.stop_after & (1 << (tag % 8)) != 0 {
                        Visit::StopAfter
                    } else {
                        Visit::Forward
                    }
                },
            );
            match result {
                Ok(w) => {
                    assert!(w.forward <= buf.len(), "forwards more than it has");
                    buf.drain(..w.forward);
                    forwarded += w.forward;
                    // After a stop the caller walks again from there.
                    if !w.stopped || buf.len() == before && w.forward == 0 {
                        break;
                    }
                }
                Err(e) => {
                    // A bad length is 08P01; a message too large to hold
                    // whole (past max_inspected) is 54000.
                    assert!(matches!(e.code.as_str(), "08P01" | "54000"), "{}", e.code);
                    events.push(Event::Error(e.message));
                    return (events, forwarded);
                }
            }
        }
    }
    (events, forwarded)
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let setup = Setup {
        max_message: 4 + input.u16() as usize,
        max_inspected: input.u16() as usize,
        wanted: input.byte(),
        stop_after: input.byte(),
    };
    let cuts = input.piece().to_vec();
    let stream = input.rest();

    let (whole, whole_forwarded) = walk(&setup, &[stream]);

    let mut pieces = Vec::new();
    let mut rest = stream;
    for c in cuts
        .iter()
        .cycle()
        .take(if cuts.is_empty() { 0 } else { 4096 })
    {
        if rest.is_empty() {
            break;
        }
        let (head, tail) = rest.split_at((*c as usize).min(rest.len()));
        pieces.push(head);
        rest = tail;
    }
    pieces.push(rest);
    let (pieced, pieced_forwarded) = walk(&setup, &pieces);

    assert_eq!(
        whole,
        pieced,
        "pieces {:?}",
        pieces.iter().map(|p| p.len()).collect::<Vec<_>>()
    );
    // After an error nothing more is forwarded (the connection closes), so
    // the counts agree only on a clean stream.
    if !matches!(whole.last(), Some(Event::Error(_))) {
        assert_eq!(whole_forwarded, pieced_forwarded);
    }
    for e in &whole {
        if let Event::Message(tag, body) = e {
            assert!(body.is_empty() || setup.wanted & (1 << (tag % 8)) != 0);
        }
    }
});
