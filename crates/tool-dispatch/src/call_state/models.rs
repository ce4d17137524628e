//! Loom models of a sync call's handshake and of its slot, run by `cargo xtask loom`, which
//! also runs each with the planted bug its documentation names.
//!
//! The slot models run the crate's own [`CallJob`] and [`Waiting`] on the real [`Pool`], with
//! loom's stand-ins for tokio's semaphore and oneshot channel (`sync.rs`). The waiter's side
//! is written out here in blocking form: it does what `Dispatch::run_sync` (`call.rs`) does in
//! its `select!`, which loom cannot run. The semaphore has `max_threads + queue_capacity`
//! permits, and each model ends by checking that every one of them came back exactly once.

use super::{Abandoned, CallJob, CallState, Reply, Run, Waiting, handshake};
use crate::{
    pool::{Faults, Job, Pool, PoolConfig, Rejected},
    sync::{
        self, Arc, AtomicBool, AtomicUsize, Gate, Ordering::SeqCst, Semaphore, oneshot, spin_until,
        thread,
    },
};

/// A waiter giving up races the job starting and finishing: a job abandoned while queued
/// never runs, any other job does, and the stuck gauge ends at zero without ever going
/// below it.
///
/// Breaking it (`cargo xtask loom` does): with `run_abandoned_job` a job given up while
/// queued runs anyway, and with `count_stuck_after_cas` the waiter counts the stuck thread
/// after marking it abandoned, so the job can uncount it first; in both, loom finds an
/// interleaving where the job uncounts a stuck thread nobody counted and the gauge goes
/// below zero (`CallState::finish`'s debug assertion).
#[test]
fn loom_waiter_and_job_agree() {
    loom::model(|| {
        let state = Arc::new(CallState::new());
        let stuck = Arc::new(AtomicUsize::new(0));
        let ran = Arc::new(AtomicBool::new(false));
        let job = {
            let (state, stuck, ran) = (Arc::clone(&state), Arc::clone(&stuck), Arc::clone(&ran));
            thread::spawn(move || {
                if state.start() {
                    ran.store(true, SeqCst);
                    thread::yield_now();
                    state.finish(&stuck);
                }
            })
        };
        let outcome = state.abandon(&stuck);
        job.join().expect("the job thread does not panic");

        assert_eq!(
            stuck.load(SeqCst),
            0,
            "every stuck thread was uncounted once"
        );
        assert_eq!(
            ran.load(SeqCst),
            outcome != Abandoned::Queued,
            "ran iff not given up while queued"
        );
    });
}

/// The dispatcher's sizing in these models: one thread, room for one queued call.
const MAX_THREADS: usize = 1;
const QUEUE_CAPACITY: usize = 1;

/// What the models' calls do: note that they ran, then wait behind their gate, if any.
#[derive(Default)]
struct Work {
    ran: AtomicBool,
    gate: Option<Gate>,
}

/// A sync call's pool job as `call.rs` builds it (`SyncJob`), with [`Work`] for the tool.
struct ModelJob {
    call: CallJob<()>,
    work: Arc<Work>,
    stuck: Arc<AtomicUsize>,
}

impl Job for ModelJob {
    fn run(self: Box<Self>) {
        let ModelJob { call, work, stuck } = *self;
        let _: Run = call.run(&stuck, || {
            work.ran.store(true, SeqCst);
            match &work.gate {
                Some(gate) => gate.wait(),
                None => thread::yield_now(),
            }
        });
    }

    fn cancel(self: Box<Self>, reason: Rejected) {
        self.call.cancel(reason);
    }
}

/// The pool, the slots and the stuck gauge of one model run.
struct Dispatcher {
    pool: Pool,
    slots: Arc<Semaphore>,
    stuck: Arc<AtomicUsize>,
}

/// One sync call in flight, as its waiter holds it.
struct Call {
    state: Arc<CallState>,
    replied: oneshot::Receiver<Reply<()>>,
    work: Arc<Work>,
}

impl Dispatcher {
    fn new() -> Dispatcher {
        Dispatcher {
            pool: Pool::new(PoolConfig {
                max_threads: MAX_THREADS,
                thread_name: "loom-tool".into(),
                faults: Faults::from_env(),
            }),
            slots: Arc::new(Semaphore::new(MAX_THREADS + QUEUE_CAPACITY)),
            stuck: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// What a turn does for a sync call: take a slot (`poll_ready`), move it into the
    /// call's job, submit the job.
    fn submit(&self, work: Work) -> Call {
        let slot = Semaphore::blocking_acquire_owned(&self.slots);
        let (job, state, replied) = handshake(slot);
        let work = Arc::new(work);
        let job = ModelJob {
            call: job,
            work: Arc::clone(&work),
            stuck: Arc::clone(&self.stuck),
        };
        // On rejection the job has already replied `Cancelled`, with the slot.
        let _ = self.pool.submit(Box::new(job));
        Call {
            state,
            replied,
            work,
        }
    }

    /// The checks every slot model ends with, once every call is over and the pool is shut
    /// down.
    fn assert_settled(&self) {
        assert_eq!(
            self.stuck.load(SeqCst),
            0,
            "every stuck thread was uncounted once"
        );
        self.slots.assert_every_permit_returned_once();
    }
}

/// The waiter waits for the answer: it gets the slot back with it, whether the job ran or
/// was cancelled, and the turn (which ends here) releases it.
fn wait_for_answer(stuck: &AtomicUsize, call: Call) -> Reply<()> {
    let mut waiting = Waiting::new(call.state, stuck);
    let reply = call
        .replied
        .blocking_recv()
        .expect("every job is run or cancelled, and replies either way");
    waiting.disarm();
    reply
}

/// A slot comes back exactly once whether its waiter waits for the answer or gives up at
/// once (a timeout, the shutdown deadline), and wherever its call then is: queued (the job
/// is skipped and releases the slot), running (the job releases it when the work returns,
/// to nobody), or just done (the waiter takes the answer and the slot after all). The bound
/// of `max_threads + queue_capacity` slots holds throughout.
///
/// Breaking it (`cargo xtask loom` does): with `skipped_job_keeps_slot` the call abandoned
/// while queued keeps its slot forever ("a slot was never returned"); with
/// `finished_job_releases_slot_twice` a job that ran frees its slot and still sends it back
/// to be released again ("a slot was released twice").
fn a_slot_comes_back_once_whether_its_waiter_waits_or_gives_up() {
    let dispatcher = Arc::new(Dispatcher::new());
    let patient = {
        let dispatcher = Arc::clone(&dispatcher);
        thread::spawn(move || {
            let call = dispatcher.submit(Work::default());
            match wait_for_answer(&dispatcher.stuck, call) {
                Reply::Finished { outcome: (), slot } => drop(slot),
                Reply::Cancelled { reason, .. } => {
                    panic!("the pool is open, yet a call was cancelled: {reason}")
                }
            }
        })
    };

    let call = dispatcher.submit(Work::default());
    let mut waiting = Waiting::new(Arc::clone(&call.state), &dispatcher.stuck);
    let gave_up = waiting.abandon();
    match gave_up {
        // The answer is on its way, with the slot.
        Abandoned::AlreadyDone => drop(call.replied.blocking_recv()),
        // The job keeps the slot and releases it as it leaves the pool.
        Abandoned::Queued | Abandoned::Running => drop(call.replied),
    }

    patient.join().expect("the patient waiter does not panic");
    // A call given up while queued may still be queued here: then shutdown cancels it.
    dispatcher.pool.shutdown(None);
    assert_eq!(
        call.work.ran.load(SeqCst),
        gave_up != Abandoned::Queued,
        "a call runs iff its waiter did not give up while it was queued"
    );
    dispatcher.assert_settled();
}

#[test]
fn loom_a_slot_comes_back_once_whether_its_waiter_waits_or_gives_up() {
    loom::model(a_slot_comes_back_once_whether_its_waiter_waits_or_gives_up);
}

/// A slot comes back exactly once when shutdown cancels its call: a call submitted as the
/// pool closes is refused, or queued and cancelled by the close, or run; its waiter gets the
/// slot back with the answer in every case.
///
/// No planted bug is specific to this model: it shares `CallJob` with the previous one, and
/// the pool's own cancellation faults (`close_drops_queued`, `submit_ignores_shutdown`) are
/// caught by the pool's models.
fn a_slot_comes_back_once_when_shutdown_cancels_its_call() {
    let dispatcher = Arc::new(Dispatcher::new());
    let racing = {
        let dispatcher = Arc::clone(&dispatcher);
        thread::spawn(move || {
            let call = dispatcher.submit(Work::default());
            let (Reply::Finished { slot, .. } | Reply::Cancelled { slot, .. }) =
                wait_for_answer(&dispatcher.stuck, call);
            drop(slot);
        })
    };

    let call = dispatcher.submit(Work::default());
    let report = dispatcher.pool.shutdown(None);
    let ran = Arc::clone(&call.work);
    match wait_for_answer(&dispatcher.stuck, call) {
        Reply::Finished { slot, .. } => {
            assert!(ran.ran.load(SeqCst), "a finished call ran");
            drop(slot);
        }
        Reply::Cancelled { reason, slot } => {
            assert_eq!(reason, Rejected::ShuttingDown);
            assert!(!ran.ran.load(SeqCst), "a cancelled call never ran");
            drop(slot);
        }
    }

    racing.join().expect("the racing waiter does not panic");
    assert_eq!(report.still_running, 0);
    dispatcher.assert_settled();
}

#[test]
fn loom_a_slot_comes_back_once_when_shutdown_cancels_its_call() {
    loom::model(a_slot_comes_back_once_when_shutdown_cancels_its_call);
}

/// Dropping a waiter (a turn's future dropped while its sync call is queued) abandons the
/// call: the pool thread skips it when it gets there, and its slot comes back.
///
/// Breaking it (`cargo xtask loom` does): with `waiting_drop_keeps_call` the dropped waiter
/// leaves its call queued as if someone still waited, and the pool runs it ("ran anyway").
fn a_call_whose_waiter_is_dropped_while_queued_never_runs() {
    let dispatcher = Dispatcher::new();
    let first = dispatcher.submit(Work {
        gate: Some(Gate::default()),
        ..Work::default()
    });
    // The only thread is inside the first call: the second one stays queued.
    spin_until("the first call ran", || first.work.ran.load(SeqCst));
    let second = dispatcher.submit(Work::default());
    drop(Waiting::new(Arc::clone(&second.state), &dispatcher.stuck));
    drop(second.replied);

    if let Some(gate) = &first.work.gate {
        gate.open();
    }
    let first_work = Arc::clone(&first.work);
    let (Reply::Finished { slot, .. } | Reply::Cancelled { slot, .. }) =
        wait_for_answer(&dispatcher.stuck, first);
    drop(slot);
    spin_until("both calls left the pool", || {
        dispatcher.pool.state().completed == 2
    });
    assert!(first_work.ran.load(SeqCst));
    assert!(
        !second.work.ran.load(SeqCst),
        "a call whose waiter was dropped while it was queued ran anyway"
    );

    let report = dispatcher.pool.shutdown(None);
    assert_eq!(report.cancelled, 0);
    dispatcher.assert_settled();
}

#[test]
fn loom_a_call_whose_waiter_is_dropped_while_queued_never_runs() {
    loom::model(a_call_whose_waiter_is_dropped_while_queued_never_runs);
}
