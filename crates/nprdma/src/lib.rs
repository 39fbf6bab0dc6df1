//! # NP-RDMA: RDMA without pinning memory
//!
//! This crate is the NP-RDMA layer of the project: a verbs-shaped API whose
//! memory regions are **not pinned**. It sits on a NIC that cannot take page
//! faults (the project's software RNIC, `rnic`) and on a pager that may swap
//! any application page out at any time (`vmem`). This page is the map of the
//! whole layer:
//!
//! | module | owns |
//! |---|---|
//! | [`engine`] | **the application API** (context, PD, MR, CQ, QP, post/poll) and the polling thread; the operation state machine, generic over its NIC backend ([`engine::Backend`], default: the software RNIC) |
//! | [`adapt`] | adapters of [`nic`]'s traits to `rnic` (verbs, owned and DMA-pool buffers, IOMMU, frame map) and `vmem` (pager, swap listeners) |
//! | [`ctrl`] | control-channel wire format (64-byte command slots) |
//! | [`cmdq`] | control-channel framing: messages ↔ slots, reassembly |
//! | [`ordering`] | per-QP in-flight table of configurable ordering |
//! | [`check`] | optimistic checks: per-atom magic, read-back, page versions, local pre-check |
//! | [`keymap`] | app rkey → (write rkey, version rkey, region) per peer, first-use sync |
//! | [`nic`] | the narrow NIC / IOMMU / memory-manager traits the layer is written against |
//! | [`shadow`] | per-MR IOMMU views + version table (12 B per page), swap-out / map-in transitions, layer-held pins |
//! | [`plan`] | application WR → strategy and NIC WRs (≤ 3), ordering descriptor, read-back batching |
//! | [`pending`] | outstanding two-sided requests by generation-checked request id |
//! | [`rob`] | reorder buffer: application completions in post order |
//! | [`seen_versions`] | the peer's page versions a QP's last checks read, standing in for the next "before" READ |
//! | [`target`] | target-side admission of a request: key, bounds, rights, pin, map-in; CPU atomics |
//! | [`trace`] | opt-in timestamp trace of the two-sided path (latency breakdowns) |
//! | `mem` | the CPU's (unsafe) access to application memory on the two-sided path |
//!
//! ## Using it
//!
//! ```text
//! Context::new(&rnic::Host, &vmem::Pager, Config) -> Context   // starts the polling thread
//!   (Context::with_nic(N, &vmem::Pager, Config) -> Context<N> for any engine::Backend N;
//!    one without IOMMU control runs the user-space mode)
//!   .alloc_pd() -> Pd    .create_cq(depth) -> Cq    .stats() / .nic_stats() / .progress()
//! Pd: unsafe reg_mr(addr, len, Access) -> Mr          // registers with the pager, never pins
//!     create_qp(&send_cq, &recv_cq, depth) -> Qp
//! Mr: lkey(), rkey(), sge(off, len); Drop deregisters (revoked at peers)
//! Qp: endpoint() -> Endpoint {host addr, qpn} (20 bytes), connect(&peer_endpoint),
//!     post_send(&[SendWr]) / post_recv(&[RecvWr]) -> Err((index, Error)), outstanding()
//! Cq: poll(&mut [Completion]) (progresses inline), poll_wait(n, timeout),
//!     req_notify() + event_fd() / wait_event(timeout) (completion channel)
//! SendWr { wr_id, op: Opcode, sge: Option<Sge>, remote_addr, rkey, signaled,
//!          order_before, order_after }      Opcode = Read | Write | WriteImm | Send |
//!          SendImm | CmpSwap | FetchAdd    Completion.status = ibv_wc_status numbers
//! ```
//! Both peers run this engine (in one process or two: nothing assumes a
//! shared address space; the control channel and the NIC's shared-memory
//! transport carry everything). Connect both sides before posting.
//!
//! ## Engine realisation and deviations from the paper
//!
//! * Two NIC CQs per context on one completion channel serve all QPs: the
//!   data QPs' send completions, and the control QPs' sends and receives
//!   (so an application thread waiting for a one-sided operation polls,
//!   and progresses, only the data CQ; it looks at the control CQ when the
//!   data CQ is idle and at least every 16th poll); application CQs are
//!   user-space queues. The polling thread
//!   spins `Config::spin` after work (up to 40× that while requests keep
//!   arriving just after it blocked; past 8 µs without work it spins
//!   yielding its core, see rnic's docs), then blocks on the channel
//!   (`interrupt_mode`: no spinning). While it spins it also serves the
//!   software NIC's request rings (`rnic::Host::set_ring_polling`), so the
//!   host's NIC thread does not spin beside it: with rnic's default
//!   `ring_rw_max` a remote fault took ≈1.1 ms across processes (two
//!   spinners in the target on 2 cores), now ≈9 µs (4–8 µs with
//!   `ring_rw_max: Some(0)`, where the target's threads are not on the
//!   one-sided path at all; BENCHMARKS.md). Requests it serves inside its
//!   NIC-CQ polls count as work (`rnic::Host::ring_passes`), and its
//!   NIC-CQ polls do not force yields (`rnic::cq::pace_own_polls`). With
//!   `Config::ring_takeover` (off by default), once blocked, it is woken when
//!   the NIC thread starts serving requests in its place
//!   (`rnic::Host::add_ring_waker`), and takes the rings back. An application thread polling its CQ
//!   progresses the engine itself (no thread hop) and the polling thread
//!   steps aside meanwhile. One lock per context serialises engine state.
//! * **Lean path** (`engine/fast.rs`): a signaled one-sided READ or
//!   WRITE (magic check, read-back or page versions) posted while nothing
//!   else of its QP is outstanding goes straight to the NIC and its
//!   completion straight to the user CQ — no ordering table, reorder buffer
//!   or pending-table entry (with nothing else in flight they would decide
//!   nothing). Any later post, a failed check, an error or a flush first
//!   *promotes* it into those structures exactly as if it had been posted
//!   there, so §5's guarantees hold unchanged.
//! * **Pipelining overlapping one-sided ops, with replay**
//!   (`Config::order.pipeline`, on by default; off = the paper's parking). Beyond the
//!   paper, `engine/replay.rs`, [`ordering`] module docs: the paper
//!   parks an op behind every overlapping in-flight op, which turns a
//!   perftest-style window on the same buffers into one op at a time. Here
//!   a READ/WRITE that overlaps only in-flight READ/WRITEs still in their
//!   optimistic one-sided phase (NIC WRs posted, check pending, deferred
//!   read-backs included) issues at once — the RC data QP executes it after
//!   them — unless it would overwrite memory an earlier one reads or part
//!   of an earlier READ's destination (that would land before the earlier
//!   READ's sampled check and could hide a torn atom from it; the long
//!   chaos test caught this on 2026-11-25). Results
//!   are final only in post order (a later op's result waits for earlier
//!   overlapping ones). If an earlier op's check fails, it goes two-sided
//!   and every later overlapping op already issued (transitively) has its
//!   one-sided result discarded and runs again after it, in post order;
//!   completions stay in post order, one per WR. **Weakening:** while such
//!   a replay is pending, a concurrent observer of the remote memory may
//!   transiently see a later overlapping WRITE's bytes before (and again
//!   after) an earlier one's; the final bytes and the completion order are
//!   RC's. Messages, atomics, order-before/after and strict mode keep the
//!   paper's parking. *Known cost:* overlapping unsignaled small WRITEs
//!   with *different* data to the same range defer their read-backs past
//!   the later WRITEs, so the earlier ones' read-backs see the later bytes
//!   and fail: they go two-sided and the later ones replay — correct, but
//!   slow (perftest-style loops write the same data and are unaffected).
//! * Read-backs land in page-aligned scratch at the remote address's page
//!   offset: with a misaligned heap buffer the NIC's copy hit a `rep movsb`
//!   slow case of this CPU (4 KiB read-back WRITE 3.8 µs instead of 1.4).
//! * WRs carry one SGE. Unsignaled small WRITEs defer their read-backs to
//!   the next signaled WR of the QP (merged per [`plan::batch_readbacks`]);
//!   beyond the paper, an idle QP also flushes them within ~10 ms so they do
//!   not hold the QP's depth forever.
//! * Reverse operations and rendezvous use **temporary plain NIC MRs** over
//!   the pinned range (registered for the request, dropped before the unpin)
//!   instead of the IOVA views: the views then need no extra remote rights
//!   (a Read MR carries only the application's REMOTE_READ, a Write MR only
//!   its REMOTE_WRITE), and a late swap-out announcement for a page whose
//!   eviction a pin is aborting cannot break them ([`shadow::MrShadow::pinned_map_in`]).
//! * Atomics, SEND data ≤ 1 KB and faulted READ/WRITE ≤ 1 KB go inline on the
//!   control channel; the target CPU copies/executes under a temporary pin.
//!   The initiator pins nothing for inline forms (its CPU copies; the NIC
//!   never touches its buffer). An inline READ of pages the target can
//!   prove never populated (the pager's state and the page table at
//!   registration, `MrEntry::reads_as_zero`) is answered with zeroes, one
//!   of a page the pager holds swapped out with the bytes read from its
//!   swap slot (`vmem::Pager::read_swapped`), one of resident pages (lazy
//!   swap-in) by a CPU copy; the pages are then pinned (zero-filled /
//!   swapped in) and mapped in right after the answer, off the initiator's
//!   critical path.
//! * The control channel's pinned command-slot receive rings (64 B × depth)
//!   are buffers of rnic's NIC-shared DMA pool (`nic::Nic::alloc_ring_buf`,
//!   `adapt::RnicBuf`; `rnic::Host::alloc_dma_buffer`), so the peer's software NIC delivers a
//!   control SEND with a memcpy instead of a cross-process copy syscall; a
//!   QP whose pool is off or full falls back to an owned heap ring.
//! * A SEND or WRITE_WITH_IMM without a posted RECV is held at the receiver
//!   for the sender's `rnr_retry` × the receiver's `min_rnr_timer`
//!   (`Qp::set_rnr`; 7 = forever) — what RC's RNR NAKs and resends amount
//!   to — then answered [`ctrl::Status::RnrNoRecv`] (RNR_RETRY_EXC_ERR, the
//!   sender's QP fails, what it sent behind is dropped); while held, the
//!   receiver tells the sender every 25 ms ([`ctrl::Status::RnrWait`]), so
//!   only a receiver that is gone or stopped lets it reach
//!   `Config::two_sided_timeout` (5 s, RETRY_EXC_ERR), like any two-sided
//!   request unanswered that long.
//! * `Qp::reset` returns a QP to RESET with its number kept (its NIC QPs
//!   reset in place), to connect it again; what was outstanding goes without
//!   a completion, as on verbs hardware. `Mr::rereg` changes an MR's PD or
//!   rights in place, keys kept.
//! * Rendezvous receives of a QP are served one at a time; the eager
//!   swap-in hook is not wired.
//! * On a NIC without IOMMU control (`ibverbs-nic`: any libibverbs device)
//!   the engine runs the paper's user-space mode (`Context::with_nic`):
//!   every READ/WRITE two-sided over MRs registered on the fly, with a
//!   bounded registration cache (`Config::reg_cache_bytes`) beyond the
//!   paper, dropped by a swap listener before eviction. Also beyond the
//!   paper, **leases** (`Config::lease_ms`, `Config::lease_bytes`): a target
//!   whose peer comes back two-sided to pages it reached lately lends it the
//!   registration of those pages, pinned, until the peer gives it back (after
//!   its time of use, with nothing of it in flight), and the peer's next
//!   READs/WRITEs of them go one-sided; deregistration, unmapping and QP
//!   teardown end leases at once, and one is lent only while every QP of the
//!   context is in the MR's PD and grants the right (the device's key reaches
//!   all its QPs). See the engine's `lease` module.
//! * Execution errors caught before the NIC (unknown key, bounds, rights)
//!   complete the WR with the verbs status but leave the QP usable; NIC
//!   errors follow the NIC (QP to ERR, WR_FLUSH_ERR behind).
//! * Deregistering an MR with operations in flight lets them finish (they
//!   hold the registration); peers learn the revocation by KeyRevoke.
//! * Key sync: a KeyQuery on the first operation that needs an unknown key
//!   (all keys if never synced, else that key), new MRs pushed to peers
//!   that have done their initial sync; unknown after the answer →
//!   REM_ACCESS_ERR.
//!
//! The sections below describe the design the engine follows.
//!
//! ## 1. Memory regions: one application MR = three NIC MRs
//!
//! `reg_mr(addr, len, access)` registers the range with the pager
//! ([`nic::MemoryManager`]; no pinning, no faulting in) and reads its
//! residency. Then, with the IOMMU capability ([`nic::IommuControl`]):
//!
//! * **Read MR** over IOVA range *R*: resident page → `Frame::Ram(page)`,
//!   absent page → `Frame::Signature`. Its rkey is the one the application
//!   sees (`app rkey`). One-sided READs *from* this host and the local side of
//!   WRITEs/SENDs go through it: absent memory reads as magic words.
//! * **Write MR** over IOVA range *W*: resident → `Ram`, absent →
//!   `Frame::BlackHole`. Remote WRITEs *to* this host and the local side of
//!   READs go through it: writes to absent memory vanish instead of faulting.
//! * **Version MR**: a pinned, plainly registered array of `u32`, one per
//!   page ([`keymap::VERSION_WORD`]), odd = resident, even = absent; 1 or 0
//!   at registration. Remote peers READ it (large transfers, §3).
//!
//! The mapping app rkey → {write rkey, version rkey, region va/len, version
//! va, page count} is a [`ctrl::KeyMapping`], kept locally in a
//! [`keymap::KeyTable`] and sent to peers (§7). A swap listener
//! ([`nic::SwapListener`]) is installed for the MR.
//!
//! **Swap-out** (listener, synchronous, before the pager reclaims the page):
//! for each page, bump the version to even *first*, then map R → Signature
//! and W → BlackHole, then one `flush()` per batch — it returns only when no
//! DMA atom that used the old frame is in flight — and return; now the pager
//! may write the page out. (Version before remap: any atom that hits a
//! special frame is then followed, on the same RC QP, by a version read that
//! sees the bump.) **Swap-in is lazy** (Linux has no swap-in notifier): a
//! page the application faults back in stays mapped to the special frames,
//! so the next RDMA access to it fails the optimistic check and goes
//! two-sided,
//! where the target pins the page (which makes it resident), maps R and W
//! back to `Ram`, and bumps the version to odd — mapping first, version
//! second, so a peer that reads an odd version finds the real frame. The
//! page stays mapped after the unpin until its next swap-out. With a pager
//! that notifies swap-ins (`vmem::PagerConfig::eager_swap_in_notify`, what
//! the `nprdma` CLI runs) the listener does the same at once, in the pass
//! that brought the pages in (a CPU fault, a pin, a prefetch): the first
//! RDMA access after it is one-sided.
//!
//! **Reclaim sees the NIC's accesses**: the software RNIC's IOMMU records an
//! accessed bit per IOVA page when DMA translates through it (as AMD/Intel
//! IOMMU page tables do), and the listener answers the pager's CLOCK
//! `test_and_clear_young` question from both views' bits, so pages peers
//! keep reading or writing get the second chance of referenced pages
//! instead of being evicted in FIFO order.
//!
//! **User-space mode** (no IOMMU capability, e.g. a real NIC without the
//! kernel module): no Read/Write views exist, so every operation takes the
//! two-sided path (§4), and the temporary pins are backed by NIC MRs
//! registered on the fly with `reg_mr` — unless the target lent the range
//! ([`ctrl::Repr::Lease`]): then a READ/WRITE goes one-sided through the
//! target's registration, pinned at both ends (`plan::Strategy::Leased`).
//!
//! ## 2. Queue pairs, CQs and the polling thread
//!
//! An application QP of depth *d* becomes one NIC data QP of send depth
//! **3·d** (an application WR becomes at most 3 NIC WRs) plus one small
//! **control QP** at a derivable QPN with a pinned command ring of
//! `64 B × d` slots each way ([`ctrl::SLOT`]); both connect lazily to the
//! peer's pair. An application CQ is a **user-space CQ** (a ring plus, in
//! interrupt mode, an eventfd the application can poll/epoll, standing in for
//! its completion channel) fed from NIC CQs. Application RECVs are kept in a
//! user-space receive queue: inbound messages arrive over the control QP.
//!
//! One **polling thread per process** serves every QP and CQ of the process,
//! as initiator and as target: it polls the NIC CQs (data and control),
//! runs the checks of §3, drives the two-sided path (§4) in both roles,
//! releases parked operations ([`ordering::OrderTable::complete`]) and pushes
//! application completions. It spins only while work is recent and then
//! blocks on an epoll set of the NIC CQs' event fds ([`nic::NicCq::event_fd`],
//! armed before sleeping) plus a doorbell eventfd, so an idle process burns
//! no core and a latency run has at most one spinning thread per process.
//! **Interrupt mode** makes it block immediately (≈5 µs more per two-sided
//! operation, no polling at all). Successful optimistic operations can also
//! be completed inline by the application thread that polls its CQ, so the
//! common path never hops threads.
//!
//! ## 3. One-sided operations: optimistic issue, then check
//!
//! Each application WR is first admitted by the QP's
//! [`ordering::OrderTable`] (issue now, or park behind a conflicting
//! in-flight op; see that module). A **local pre-check**
//! ([`check::precheck_local`] with [`shadow::MrShadow::is_mapped`]: odd
//! version = the NIC views map the real page) catches local pages that are absent *or*
//! were lazily swapped back in but are still mapped to the special frames;
//! for those the initiator pins the pages, maps them in
//! ([`shadow::MrShadow::map_in`], under the pin so the page cannot vanish
//! in between), unpins, and then issues — local CPU work instead of the RTT
//! a doomed optimistic attempt would cost. Then, per opcode:
//!
//! * **READ** → 1 NIC READ: local through the local Write MR, remote through
//!   the app rkey (remote Read MR). On completion [`check::check_read`] looks
//!   at one aligned `u32` per DMA atom, on the atom grids of both the target
//!   and the initiator address (use the smaller of the two hosts' max TLP).
//!   The initiator also compares its local page versions before/after, which
//!   catches a local swap-out during the DMA (those atoms went to the black
//!   hole). Clean → application CQE. Suspect → two-sided (§4).
//! * **Small WRITE** (≤ the versioning threshold, ~16 KB, configurable) → NIC
//!   WRITE (local Read MR → remote Write MR via the mapped write rkey)
//!   immediately followed on the same QP by a NIC READ of the same remote
//!   range through the app rkey into a pinned **temporary buffer**. RC
//!   in-order execution makes the READ see the WRITE. [`check::check_readback`]:
//!   equal to the source and no magic → success; else two-sided.
//! * **Unsignaled WRITEs** defer their read-backs: the WRITE is posted
//!   unsignaled and recorded; the read-backs of all deferred WRITEs of the QP
//!   (contiguous ranges merged by [`plan::batch_readbacks`]) are posted in front of the next *signaled*
//!   WR, whose application completion is generated only after they all pass.
//!   The deferred WRITEs stay in the ordering table until checked (an
//!   overlapping READ/WRITE may pipeline behind them and is replayed if
//!   their check fails, see the deviations above; anything else parks);
//!   a failed check redoes that WRITE two-sided before the signaled WR
//!   completes.
//! * **Large WRITE** (and, optionally, large READ — page versioning
//!   instead of per-atom checks) → 3 NIC WRs in a row: READ the remote
//!   version words ([`keymap::Translation::version_addr`]/`version_len`
//!   through the version rkey), the WRITE/READ itself, READ the version words
//!   again; [`check::check_versions`] (equal and odd per page), plus the
//!   local version comparison. Costs 8 B per page of extra traffic. On an
//!   idle QP (the lean path) whose last checks read the versions of every
//!   page of the range, those stand in for the first READ
//!   ([`seen_versions`]: versions only grow, so the same odd version read
//!   after the operation means the page never moved in between): 2 NIC WRs.
//! * **Atomics** (CMP_SWP, FETCH_ADD) are not idempotent, so they are never
//!   optimistic: always two-sided ([`ctrl::Repr::Atomic`]); the target CPU
//!   pins the 8 bytes and executes the operation (all NP-RDMA atomics on a
//!   host run on that host's CPU, so they are atomic with each other), and
//!   returns the original value ([`ctrl::Repr::AtomicResp`]).
//! * **SEND / SEND_WITH_IMM**: ≤ the inline limit (1 KB) →
//!   [`ctrl::Repr::SendInline`] through the control ring; the receiver's
//!   polling thread takes the next posted application RECV, pins its buffer,
//!   copies, unpins, and completes it. Larger → **rendezvous**: the sender
//!   pins its buffer ([`nic::Pinned`]), sends [`ctrl::Repr::SendRendezvous`]
//!   {addr, len, key, imm}; the receiver pins the next RECV buffer, reverse
//!   READs the data, unpins, completes the RECV, and answers
//!   [`ctrl::Repr::Completion`], on which the sender unpins and completes
//!   the SEND. No RECV posted → the request waits per the QP's RNR policy,
//!   then completes with [`ctrl::Status::RnrNoRecv`] (RNR_RETRY_EXC_ERR).
//! * **WRITE_WITH_IMM** → the large-WRITE pattern (versions, WRITE,
//!   versions; two-sided on a failed check), then
//!   [`ctrl::Repr::WriteImmNotify`] {addr, len, rkey, imm}; the receiver
//!   consumes a RECV and completes it with the immediate. (The receiver can
//!   re-check that the range's versions are odd; a black-holed WRITE to a
//!   page that was lazily swapped back in would not show magic to a CPU
//!   check, which is why the initiator verifies versions itself.)
//!
//! ## 4. The two-sided path (page-fault handling)
//!
//! Initiator, for a suspect READ/WRITE of `len` bytes:
//! 1. pin the local buffer ([`nic::Pinned`]), which faults it in, and map its
//!    pages R/W → `Ram` (and bump their versions) so the NIC can reach it;
//! 2. send [`ctrl::Repr::Fault`] {op, req id, local addr + the key of its
//!    Write MR (READ) or Read MR (WRITE), remote addr + app rkey, len,
//!    `inline_ok`} — or, for ≤ 1 KB, the inline forms
//!    ([`ctrl::Repr::WriteInline`] / [`ctrl::Repr::ReadInline`]) which avoid
//!    the reverse operation and the remote temporary pin's NIC work;
//! 3. the target's polling thread validates the key, the bounds and the
//!    MR's access rights — the CPU acts for the peer, so it must check what
//!    the NIC would — pins the range (faulting it in on *its* CPU) and maps
//!    it back (§1): [`target::admit`] returns a [`target::Grant`] holding
//!    the pin;
//! 4. the target issues the **reverse** WRITE (for a READ) or READ (for a
//!    WRITE) against the initiator's pinned buffer (or copies inline data);
//! 5. on its completion the target unpins and sends
//!    [`ctrl::Repr::Completion`] {req id, status, byte len}
//!    (or [`ctrl::Repr::ReadInlineResp`] with the data);
//! 6. the initiator unpins, copies inline data if any, and generates the
//!    application CQE; it then releases parked ops behind it.
//!
//! **Retry mode** (`retry_mode` flag): in step 4 the target answers
//! [`ctrl::Repr::ReceiverReady`] after pinning; the initiator re-runs the
//! one-sided operation and sends [`ctrl::Repr::Release`] when done, on which
//! the target unpins. Useful where reverse operations are not allowed.
//!
//! Request ids index a per-QP table of outstanding two-sided requests
//! ([`pending::Pending`]: generation-checked, so a stale or forged response
//! completes nothing); every entry owns its pins as RAII guards, so a completion, an error, or a
//! teardown releases them exactly once.
//!
//! ## 5. Ordering
//!
//! Optimistic operations overtake a slow two-sided one, which plain RC
//! ordering forbids. [`ordering::OrderTable`] restores the guarantees that
//! matter: ops with overlapping memory (not read/read), message ops among
//! themselves and messages vs. remote writes are ordered; the per-WR
//! order-before / order-after bits and a strict mode give full ordering on
//! request. Parked ops wait in a FIFO, so the issue order within a QP is the
//! post order. (Overlapping one-sided ops pipeline behind optimistic ones
//! and are replayed when one fails: see the deviations above.) Application completions of a QP are delivered in post order
//! ([`rob::CompletionOrder`]: a finished op waits until every op posted
//! before it has finished), as RC requires — in particular a signaled
//! completion still implies that all earlier unsignaled WRs are done.
//!
//! ## 6. Control channel
//!
//! Messages ([`ctrl::Repr`]) occupy whole 64-byte slots; a message longer
//! than one slot (inline data up to [`ctrl::CtrlConfig::max_inline`], many key
//! mappings) continues in the next slots. Each slot travels as one SEND into
//! one 64-byte RECV buffer of the peer's pinned ring; the slots of a message
//! are posted as one WR chain, so they arrive consecutively
//! ([`cmdq::slots`], [`cmdq::Reassembler`], which reads the first slot's
//! header with [`ctrl::message_len`]). Malformed messages are rejected with
//! a [`ctrl::CtrlError`]; requests with a readable id are answered with
//! [`ctrl::Status::RemoteInvalid`], a broken stream moves the QP pair to ERR.
//! Flow control is RC's own: the receiver re-posts slot buffers as it
//! consumes them and the control QP uses infinite RNR retry.
//! ([`ctrl::Repr::Pad`] exists for a future RDMA-WRITE-into-ring variant,
//! where a message must not wrap the ring.)
//!
//! ## 7. Key synchronisation
//!
//! Keys cannot be synced at QP creation (the peer may not be ready). On the
//! **first use** of a QP the initiator sends [`ctrl::Repr::KeyQuery`] (all)
//! and parks the QP's operations until the peer's
//! [`keymap::KeyTable::sync_messages`] (KeySync chunks, `more` on all but the
//! last) have been applied to its [`keymap::PeerKeys`] — one extra RTT, once
//! per QP. *After that initial synchronisation* (the peer's KeyQuery has
//! reached us) a newly registered MR is pushed to the peer as an
//! unsolicited KeySync, and a deregistered one as
//! [`ctrl::Repr::KeyRevoke`]; before it nothing is pushed (the peer's QP may
//! not be connected yet, and its first use fetches the whole table). An rkey still unknown at use triggers one
//! `KeyQuery{rkey}`; if still unknown the WR completes with REM_ACCESS_ERR.
//! Only the answer to a query sent *after* the WR was posted can fail it:
//! a WR posted while the first-use query is still out sends its own query,
//! since the older answer may be a snapshot from before the key existed.
//!
//! ## 8. Teardown and errors
//!
//! Every posted application WR yields exactly one completion. Destroying a
//! QP (or an error moving it to ERR) moves the NIC QPs to ERR
//! ([`nic::NicQp::set_error`]), drains parked ops
//! ([`ordering::OrderTable::drain_parked`]) and completes them, the
//! outstanding two-sided requests and the posted RECVs with WR_FLUSH_ERR,
//! dropping their pins. [`engine::Qp::set_error`] (`ibv_modify_qp(IBV_QPS_ERR)`)
//! does the same flush but keeps the QP: later posts on it are accepted and
//! complete with WR_FLUSH_ERR (rdma-core semantics); the peer's requests to it
//! fail at the peer. Deregistering an MR removes its swap listener (which
//! waits for a running call), frees its IOVA ranges and its version MR, and
//! revokes its key at the peers; WRs still using it fail like on hardware.
//! Bad input (unknown key, out of bounds, missing access, malformed control
//! message) is a verbs error status, never a panic.
//!
//! ## Example: the initiator's decisions for one small WRITE
//!
//! ```
//! use nprdma::check::{check_readback, CheckConfig};
//! use nprdma::ctrl::{CtrlConfig, KeyMapping, Repr};
//! use nprdma::keymap::{KeyTable, PeerKeys};
//! use nprdma::ordering::{Admit, OrderConfig, OrderTable, Range};
//! use nprdma::plan::{choose, nic_steps, order_desc, AppOp, PlanConfig, Strategy};
//!
//! // The target registered a 3-page MR and answers our first-use KeyQuery.
//! let mut target_keys = KeyTable::new(4096).unwrap();
//! target_keys
//!     .insert(KeyMapping {
//!         app_rkey: 0x11, write_rkey: 0x12, version_rkey: 0x13, page_count: 3,
//!         region_va: 0x7000_0000, region_len: 3 * 4096, version_va: 0x5000,
//!     })
//!     .unwrap();
//! let ctrl = CtrlConfig::default();
//! let mut peer = PeerKeys::new(4096).unwrap();
//! peer.begin_sync(1);
//! for msg in target_keys.sync_messages(1, &ctrl) {
//!     // (in reality: emitted into slots, sent, reassembled, parsed)
//!     let mut buf = vec![0; msg.buffer_len()];
//!     msg.emit(&mut buf, &ctrl).unwrap();
//!     peer.apply(&Repr::parse_bytes(&buf, &ctrl).unwrap()).unwrap();
//! }
//! assert!(!peer.needs_sync());
//!
//! // The application posts a signaled 64-byte WRITE.
//! let (local, remote, len) = (0x10_0000u64, 0x7000_1000u64, 64u64);
//! let t = peer.lookup(0x11, remote, len).unwrap();
//! let mut qp: OrderTable<u64> = OrderTable::new(OrderConfig::default());
//! let desc = order_desc(AppOp::Write, Range::new(local, len), Range::new(remote, len), false, false, 1024);
//! assert!(matches!(qp.submit(desc, 42).unwrap(), Admit::Issue(_, 42)));
//! let s = choose(AppOp::Write, len, true, &PlanConfig::default());
//! assert_eq!(s, Strategy::WriteReadback { deferred: false });
//! let steps = nic_steps(s, remote, len, &t); // WRITE via write rkey, READ-back via app rkey
//! assert_eq!((steps[0].rkey, steps[1].rkey), (0x12, 0x11));
//!
//! // The read-back came back equal to the source and without magic words.
//! let src = [7u8; 64];
//! assert!(check_readback(&src, &src, remote, &CheckConfig::default()).is_ok());
//! ```
#![deny(unsafe_code)]

pub mod adapt;
pub mod check;
pub mod cmdq;
pub mod ctrl;
pub mod engine;
pub mod keymap;
mod mem;
pub mod nic;
pub mod ordering;
pub mod pending;
pub mod plan;
pub mod rob;
pub mod seen_versions;
pub mod shadow;
pub mod target;
pub mod trace;

#[cfg(test)]
mod testutil;

pub use engine::{
    Access, CompOp, Completion, Config, Context, Cq, Endpoint, Error, Mr, Opcode, Pd, Qp, RecvWr,
    SendWr, Sge, Srq, Stats,
};
