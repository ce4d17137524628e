//! The ledger's delivery rules, with readers on tasks of their own as a server's connections
//! are: each group once, in order, redelivered when a reader goes away, bounded.

use std::{collections::BTreeSet, sync::Arc, time::Duration};

use async_grpo_stream::{Ledger, LedgerError, Reader};

/// Waits at most 10 s for `future`: a test that would hang fails instead.
async fn within<T>(future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), future)
        .await
        .expect("the ledger answered within 10 s")
}

#[tokio::test]
async fn groups_come_in_position_order_and_an_acknowledged_one_is_gone() {
    let ledger = Ledger::new(16);
    for group in 0..5u32 {
        assert_eq!(within(ledger.push(group * 10)).await, Ok(u64::from(group)));
    }
    let reader = Reader(1);
    for expected in 0..5u64 {
        let (position, group) = within(ledger.next(reader)).await.expect("a group");
        assert_eq!((position, group), (expected, expected as u32 * 10));
        ledger.ack(reader, position).expect("held");
    }
    assert_eq!(
        ledger.ack(reader, 0),
        Err(LedgerError::NotHeld {
            reader: 1,
            position: 0
        }),
        "acknowledged twice"
    );
    ledger.close();
    assert_eq!(within(ledger.next(reader)).await, None);
}

#[tokio::test]
async fn a_reader_cannot_acknowledge_what_another_holds() {
    let ledger = Ledger::new(4);
    within(ledger.push("a")).await.expect("pushed");
    let (position, _) = within(ledger.next(Reader(1))).await.expect("a group");
    assert!(ledger.ack(Reader(2), position).is_err());
    assert!(ledger.ack(Reader(1), 7).is_err(), "never delivered");
    assert_eq!(ledger.ack(Reader(1), position), Ok(()));
}

#[tokio::test]
async fn a_reader_that_goes_away_gives_its_groups_back_first_and_in_order() {
    let ledger = Ledger::new(16);
    for group in 0..6u32 {
        within(ledger.push(group)).await.expect("pushed");
    }
    let (gone, other) = (Reader(1), Reader(2));
    let held: Vec<u64> = [
        within(ledger.next(gone)).await,
        within(ledger.next(other)).await,
        within(ledger.next(gone)).await,
    ]
    .into_iter()
    .map(|taken| taken.expect("a group").0)
    .collect();
    assert_eq!(held, [0, 1, 2]);
    assert_eq!(ledger.release(gone), 2);
    assert!(
        ledger.ack(gone, 0).is_err(),
        "given back: no longer its to acknowledge"
    );
    let order: Vec<u64> = [
        within(ledger.next(other)).await,
        within(ledger.next(other)).await,
        within(ledger.next(other)).await,
    ]
    .into_iter()
    .map(|taken| taken.expect("a group").0)
    .collect();
    assert_eq!(
        order,
        [0, 2, 3],
        "the groups given back, then the next never delivered"
    );
}

#[tokio::test]
async fn ack_through_acknowledges_only_the_readers_own_groups() {
    let ledger = Ledger::new(16);
    for group in 0..4u32 {
        within(ledger.push(group)).await.expect("pushed");
    }
    let (one, two) = (Reader(1), Reader(2));
    for reader in [one, two, one, two] {
        within(ledger.next(reader)).await.expect("a group");
    }
    assert_eq!(
        ledger.ack_through(one, 2),
        vec![0, 2],
        "its own, not reader 2's 1"
    );
    assert_eq!(ledger.stats().leased, 2);
    assert_eq!(ledger.release(two), 2, "positions 1 and 3 still its own");
}

#[tokio::test]
async fn push_waits_while_capacity_groups_are_unacknowledged() {
    let ledger = Arc::new(Ledger::new(2));
    within(ledger.push(0u32)).await.expect("pushed");
    within(ledger.push(1u32)).await.expect("pushed");
    let third = tokio::spawn({
        let ledger = Arc::clone(&ledger);
        async move { ledger.push(2u32).await }
    });
    // Delivered is still held: only an acknowledgement makes room.
    let (position, _) = within(ledger.next(Reader(1))).await.expect("a group");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!third.is_finished(), "pushed past the capacity");
    assert_eq!(ledger.stats().waiting + ledger.stats().leased, 2);
    ledger.ack(Reader(1), position).expect("held");
    assert_eq!(within(third).await.expect("the task"), Ok(2));
}

#[tokio::test]
async fn settled_waits_for_the_last_acknowledgement_not_the_last_delivery() {
    let ledger = Arc::new(Ledger::new(4));
    within(ledger.settled()).await;
    within(ledger.push(0u32)).await.expect("pushed");
    within(ledger.push(1u32)).await.expect("pushed");
    let settled = tokio::spawn({
        let ledger = Arc::clone(&ledger);
        async move { ledger.settled().await }
    });
    let (first, _) = within(ledger.next(Reader(1))).await.expect("a group");
    let (second, _) = within(ledger.next(Reader(1))).await.expect("a group");
    ledger.ack(Reader(1), first).expect("held");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        !settled.is_finished(),
        "settled with a group delivered, not acknowledged"
    );
    ledger.ack(Reader(1), second).expect("held");
    within(settled).await.expect("the task");
}

#[tokio::test]
async fn closing_ends_waiting_readers_and_refuses_pushes() {
    let ledger = Arc::new(Ledger::<u32>::new(1));
    within(ledger.push(0)).await.expect("pushed");
    let blocked = tokio::spawn({
        let ledger = Arc::clone(&ledger);
        async move { ledger.push(1).await }
    });
    let (position, _) = within(ledger.next(Reader(1))).await.expect("a group");
    let idle = tokio::spawn({
        let ledger = Arc::clone(&ledger);
        async move { ledger.next(Reader(2)).await }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    ledger.close();
    assert_eq!(
        within(blocked).await.expect("the task"),
        Err(LedgerError::Closed)
    );
    // Group 0 is still reader 1's: were it given back, reader 2 would get it.
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(
        !idle.is_finished(),
        "ended while a group could still come back"
    );
    assert_eq!(ledger.ack(Reader(1), position), Ok(()));
    assert_eq!(within(idle).await.expect("the task"), None);
}

#[tokio::test]
async fn after_close_a_group_given_back_still_reaches_a_reader() {
    let ledger = Arc::new(Ledger::<u32>::new(4));
    within(ledger.push(9)).await.expect("pushed");
    within(ledger.next(Reader(1))).await.expect("a group");
    ledger.close();
    let other = tokio::spawn({
        let ledger = Arc::clone(&ledger);
        async move { ledger.next(Reader(2)).await }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    ledger.release(Reader(1));
    assert_eq!(within(other).await.expect("the task"), Some((0, 9)));
}

#[tokio::test]
async fn a_resumed_ledger_continues_the_positions() {
    let ledger = Ledger::starting_at(4, 40);
    assert_eq!(within(ledger.push(())).await, Ok(40));
    assert_eq!(ledger.stats().next, 41);
}

/// A resumed run gives back its earlier run's unacknowledged groups (3 and 7 of 10): served
/// first, in position order, whatever order they were restored in, then the new ones.
#[tokio::test]
async fn restored_groups_are_served_first_at_their_positions() {
    let ledger = Ledger::starting_at(8, 10);
    assert_eq!(within(ledger.push("new")).await, Ok(10));
    within(ledger.restore(7, "seven"))
        .await
        .expect("an earlier position");
    within(ledger.restore(3, "three"))
        .await
        .expect("an earlier position");
    let reader = Reader(1);
    let mut served = Vec::new();
    for _ in 0..3 {
        served.push(within(ledger.next(reader)).await.expect("a group"));
    }
    assert_eq!(served, [(3, "three"), (7, "seven"), (10, "new")]);
    assert_eq!(
        within(ledger.restore(7, "again")).await,
        Err(LedgerError::NotRestorable { position: 7 }),
        "held (leased) already"
    );
    assert_eq!(
        within(ledger.restore(11, "later")).await,
        Err(LedgerError::NotRestorable { position: 11 }),
        "not an earlier run's"
    );
}

/// Restoring waits for room as a push does: a resumed run's backlog is bounded too.
#[tokio::test]
async fn restoring_waits_for_room() {
    let ledger = Arc::new(Ledger::starting_at(1, 5));
    within(ledger.restore(0, 0u8)).await.expect("room for one");
    let second = tokio::spawn({
        let ledger = Arc::clone(&ledger);
        async move { ledger.restore(1, 1).await }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(!second.is_finished(), "restored past capacity");
    let (position, _) = within(ledger.next(Reader(1))).await.expect("a group");
    ledger.ack(Reader(1), position).expect("held");
    within(second)
        .await
        .expect("the task")
        .expect("restored once room was made");
}

/// Four readers on a multi-threaded runtime, one of them dropping out part-way, share 2,000
/// groups pushed through a ledger of 16: every group is acknowledged exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_readers_split_the_groups_with_none_twice_and_none_lost() {
    const GROUPS: u64 = 2_000;
    let ledger = Arc::new(Ledger::new(16));
    // The writer may close before reader 0 leaves: the others wait for what it holds.
    let writer = tokio::spawn({
        let ledger = Arc::clone(&ledger);
        async move {
            for group in 0..GROUPS {
                ledger.push(group).await.expect("open");
            }
            ledger.close();
        }
    });
    let readers: Vec<_> = (0..4u64)
        .map(|id| {
            let ledger = Arc::clone(&ledger);
            tokio::spawn(async move {
                let reader = Reader(id);
                let mut acknowledged = Vec::new();
                while let Some((position, group)) = ledger.next(reader).await {
                    assert_eq!(position, group, "a group at another's position");
                    // Reader 0 leaves after 100 groups, acknowledging none of its last two.
                    if id == 0 && acknowledged.len() == 100 {
                        ledger.next(reader).await;
                        assert_eq!(ledger.release(reader), 2);
                        break;
                    }
                    ledger.ack(reader, position).expect("held");
                    acknowledged.push(position);
                    if position % 7 == 0 {
                        tokio::task::yield_now().await;
                    }
                }
                acknowledged
            })
        })
        .collect();
    within(writer).await.expect("the writer");
    let mut seen = BTreeSet::new();
    for reader in readers {
        for position in within(reader).await.expect("a reader") {
            assert!(seen.insert(position), "group {position} acknowledged twice");
        }
    }
    assert_eq!(seen, (0..GROUPS).collect::<BTreeSet<_>>(), "groups lost");
    assert_eq!(ledger.stats().leased + ledger.stats().waiting, 0);
}
