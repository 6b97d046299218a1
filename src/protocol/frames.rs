//! Walking a byte stream message by message while forwarding it.
//!
//! The forwarding path never buffers a large message whole: a [`FrameWalker`]
//! looks at each message header, asks for the whole body only of the few
//! message types usher must read (ReadyForQuery, ParameterStatus, ...), and
//! lets everything else stream through in whatever pieces the socket gives.

use super::error::PgError;
use super::messages::printable;

/// Bodies usher reads must fit in this many bytes.
pub const MAX_INSPECTED_BODY: usize = 1024 * 1024;

/// What to do with the message just visited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Visit {
    /// Forward it and go on.
    Forward,
    /// Forward it, then stop walking (e.g. the transaction ended).
    StopAfter,
    /// Do not forward it; stop walking before it (it stays in the buffer).
    StopBefore,
}

/// The outcome of one walk over a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Walked {
    /// Bytes at the front of the buffer that may be forwarded now.
    pub forward: usize,
    /// A visitor asked to stop.
    pub stopped: bool,
    /// The last byte of at least one message was walked (a message came
    /// in whole: what resets an idle timer, unlike bytes of one unfinished).
    pub ended: bool,
    /// The walk stopped before a message ([`Visit::StopBefore`]): its whole
    /// length, tag and header included (it starts at `forward`).
    pub held: Option<usize>,
}

/// Tracks message boundaries across reads of one direction of a connection.
#[derive(Debug)]
pub struct FrameWalker {
    /// Bytes of the current (streamed) message body still to come.
    skip: usize,
    /// Largest message accepted.
    max_message: usize,
    /// Largest body a visitor may ask to see whole.
    max_inspected: usize,
}

impl FrameWalker {
    pub fn new(max_message: usize) -> Self {
        FrameWalker {
            skip: 0,
            max_message,
            max_inspected: MAX_INSPECTED_BODY,
        }
    }

    /// Lets visitors see bodies of up to `limit` bytes whole (default
    /// [`MAX_INSPECTED_BODY`]).
    pub fn inspect_up_to(mut self, limit: usize) -> Self {
        self.max_inspected = limit;
        self
    }

    /// True when the walker is at a message boundary.
    pub fn at_boundary(&self) -> bool {
        self.skip == 0
    }

    /// Walks the messages in `buf`. `wants_body(tag, len)` says which
    /// messages (by type and body length) must be visited whole; the others
    /// are visited with an empty body as soon as their header is in. Returns
    /// how many bytes may be forwarded.
    pub fn walk(
        &mut self,
        buf: &[u8],
        wants_body: impl Fn(u8, usize) -> bool,
        visit: impl FnMut(u8, &[u8]) -> Visit,
    ) -> Result<Walked, PgError> {
        self.walk_inner(buf, |tag, len, _| Some(wants_body(tag, len)), false, visit)
    }

    /// Like [`FrameWalker::walk`], but `wants_body(tag, len, head)` also
    /// sees the start of the body that is already in (`head`) and may
    /// answer `None`: more of it is needed to decide (the walk waits for
    /// more bytes; once the whole body is in, `None` means yes). A streamed
    /// message is visited with its head instead of an empty body, so a
    /// visitor can read the names at the start of a large message without
    /// holding it whole.
    pub fn walk_peeking(
        &mut self,
        buf: &[u8],
        wants_body: impl Fn(u8, usize, &[u8]) -> Option<bool>,
        visit: impl FnMut(u8, &[u8]) -> Visit,
    ) -> Result<Walked, PgError> {
        self.walk_inner(buf, wants_body, true, visit)
    }

    /// The current message's header and the first `consumed` bytes of its
    /// body were taken by the caller (a visitor stopped before it): the
    /// remaining `len - consumed` bytes of the body stream through.
    pub fn stream_rest_of_body(&mut self, remaining: usize) {
        debug_assert_eq!(self.skip, 0, "only at a message boundary");
        self.skip = remaining;
    }

    fn walk_inner(
        &mut self,
        buf: &[u8],
        wants_body: impl Fn(u8, usize, &[u8]) -> Option<bool>,
        peek: bool,
        mut visit: impl FnMut(u8, &[u8]) -> Visit,
    ) -> Result<Walked, PgError> {
        let mut pos = 0;
        let mut ended = false;
        loop {
            if self.skip > 0 {
                let take = self.skip.min(buf.len() - pos);
                pos += take;
                self.skip -= take;
                if self.skip > 0 {
                    break;
                }
                ended = true;
            }
            if buf.len() - pos < 5 {
                break;
            }
            let tag = buf[pos];
            let len = u32::from_be_bytes([buf[pos + 1], buf[pos + 2], buf[pos + 3], buf[pos + 4]])
                as usize;
            if len < 4 || len > self.max_message {
                return Err(PgError::protocol(format!(
                    "invalid message length {len} for message type '{}' (limit {} bytes)",
                    printable(tag),
                    self.max_message
                )));
            }
            let total = 1 + len;
            let whole = buf.len() - pos >= total;
            let head = &buf[pos + 5..(pos + total).min(buf.len())];
            let wanted = match wants_body(tag, len - 4, head) {
                Some(w) => w,
                None if whole => true,
                None if head.len() >= self.max_inspected => true,
                None => break, // wait for more of the head
            };
            let step = if wanted {
                if len - 4 > self.max_inspected {
                    return Err(PgError::fatal(
                        super::error::sqlstate::PROGRAM_LIMIT_EXCEEDED,
                        format!(
                            "message type '{}' of {len} bytes is too large for usher to hold (limit {} bytes)",
                            printable(tag),
                            self.max_inspected
                        ),
                    ));
                }
                if !whole {
                    break; // wait for the rest of it
                }
                let step = visit(tag, &buf[pos + 5..pos + total]);
                if step != Visit::StopBefore {
                    pos += total;
                    ended = true;
                }
                step
            } else {
                let step = visit(tag, if peek { head } else { &[] });
                if step != Visit::StopBefore {
                    pos += 5;
                    self.skip = len - 4;
                    ended |= self.skip == 0;
                }
                step
            };
            if step != Visit::Forward {
                // Complete a streamed message's body before stopping after it.
                if step == Visit::StopAfter && self.skip > 0 {
                    let take = self.skip.min(buf.len() - pos);
                    pos += take;
                    self.skip -= take;
                    ended |= self.skip == 0;
                }
                return Ok(Walked {
                    forward: pos,
                    stopped: true,
                    ended,
                    held: (step == Visit::StopBefore).then_some(total),
                });
            }
        }
        Ok(Walked {
            forward: pos,
            stopped: false,
            ended,
            held: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::{BufMut, BytesMut};

    fn msg(buf: &mut BytesMut, tag: u8, body: &[u8]) {
        buf.put_u8(tag);
        buf.put_u32(body.len() as u32 + 4);
        buf.put_slice(body);
    }

    #[test]
    fn peeking_waits_for_the_head_and_streams_with_it() {
        let mut data = BytesMut::new();
        msg(&mut data, b'B', b"\0s1\0params...");
        let mut w = FrameWalker::new(1 << 20).inspect_up_to(4);
        let mut seen = vec![];
        // The names are not all in: the walk waits.
        let wants = |_, _, head: &[u8]| head.iter().filter(|b| **b == 0).nth(1).map(|_| false);
        let r = w
            .walk_peeking(&data[..7], wants, |t, b| {
                seen.push((t, b.to_vec()));
                Visit::Forward
            })
            .unwrap();
        assert_eq!((r.forward, seen.len()), (0, 0));
        // Now they are: visited with its head, streamed although the body is
        // larger than the inspection limit, and a stop before it holds it.
        let r = w
            .walk_peeking(&data[..12], wants, |t, b| {
                seen.push((t, b.to_vec()));
                Visit::StopBefore
            })
            .unwrap();
        assert_eq!(
            r,
            Walked {
                forward: 0,
                stopped: true,
                ended: false,
                held: Some(data.len()),
            }
        );
        assert_eq!(seen, [(b'B', b"\0s1\0par".to_vec())]);
        // The caller took the header and names; the rest streams.
        w.stream_rest_of_body(data.len() - 9);
        let r = w
            .walk_peeking(&data[9..], wants, |_, _| Visit::Forward)
            .unwrap();
        assert_eq!((r.forward, r.ended), (data.len() - 9, true));
        assert!(w.at_boundary());
    }

    #[test]
    fn a_held_message_past_the_limit_is_54000() {
        let mut data = BytesMut::new();
        msg(&mut data, b'P', &[1u8; 100]);
        let mut w = FrameWalker::new(1 << 20).inspect_up_to(50);
        let e = w
            .walk(&data, |_, _| true, |_, _| Visit::Forward)
            .unwrap_err();
        assert_eq!(e.code, "54000");
    }

    #[test]
    fn streams_large_messages_in_pieces() {
        let mut data = BytesMut::new();
        msg(&mut data, b'D', &[7u8; 100]);
        msg(&mut data, b'Z', b"I");
        let mut w = FrameWalker::new(1 << 20);
        let mut seen = vec![];
        // First piece: header and part of the DataRow.
        let r = w
            .walk(
                &data[..30],
                |t, _| t == b'Z',
                |t, b| {
                    seen.push((t, b.to_vec()));
                    Visit::Forward
                },
            )
            .unwrap();
        assert_eq!(
            (r.forward, r.ended),
            (30, false),
            "a message begun, none ended"
        );
        // Second piece: the rest, plus half of ReadyForQuery: it waits.
        let rest = &data[30..data.len() - 2];
        let r = w
            .walk(
                rest,
                |t, _| t == b'Z',
                |t, b| {
                    seen.push((t, b.to_vec()));
                    Visit::Forward
                },
            )
            .unwrap();
        assert_eq!((r.forward, r.ended), (75, true), "the DataRow ended");
        let r = w
            .walk(
                &data[105..],
                |t, _| t == b'Z',
                |t, b| {
                    seen.push((t, b.to_vec()));
                    Visit::StopAfter
                },
            )
            .unwrap();
        assert_eq!(
            r,
            Walked {
                forward: 6,
                stopped: true,
                ended: true,
                held: None,
            }
        );
        assert_eq!(seen, vec![(b'D', vec![]), (b'Z', b"I".to_vec())]);
        assert!(w.at_boundary());
    }

    #[test]
    fn wants_body_is_asked_with_the_body_length() {
        let mut data = BytesMut::new();
        msg(&mut data, b'E', &[1u8; 10]);
        msg(&mut data, b'E', &[2u8; 100]);
        let mut w = FrameWalker::new(1 << 20);
        let mut seen = vec![];
        let r = w
            .walk(
                &data,
                |t, len| t == b'E' && len <= 10,
                |_, b| {
                    seen.push(b.len());
                    Visit::Forward
                },
            )
            .unwrap();
        assert_eq!(r.forward, data.len());
        assert_eq!(
            seen,
            vec![10, 0],
            "the small one whole, the large one streamed"
        );
    }

    #[test]
    fn stop_before_leaves_the_message() {
        let mut data = BytesMut::new();
        msg(&mut data, b'Q', b"select 1\0");
        msg(&mut data, b'X', b"");
        let mut w = FrameWalker::new(1 << 20);
        let r = w
            .walk(
                &data,
                |_, _| false,
                |t, _| {
                    if t == b'X' {
                        Visit::StopBefore
                    } else {
                        Visit::Forward
                    }
                },
            )
            .unwrap();
        assert_eq!(
            r,
            Walked {
                forward: 14,
                stopped: true,
                ended: true,
                held: Some(5),
            }
        );
    }

    #[test]
    fn rejects_bad_lengths() {
        let mut data = BytesMut::new();
        data.put_u8(b'Q');
        data.put_u32(2);
        let mut w = FrameWalker::new(1 << 20);
        assert!(w.walk(&data, |_, _| false, |_, _| Visit::Forward).is_err());
        let mut data = BytesMut::new();
        data.put_u8(b'Q');
        data.put_u32(5000);
        let mut w = FrameWalker::new(4096);
        let e = w
            .walk(&data, |_, _| false, |_, _| Visit::Forward)
            .unwrap_err();
        assert_eq!(e.code, "08P01");
    }
}
