//! [`ResponseFuture`]: the future of one turn.

use std::{
    fmt,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use futures::future::BoxFuture;

use crate::{error::DispatchError, tool::ToolResult};

/// The future a [`crate::ToolDispatcher`] returns for a turn. It holds the turn's pool slot.
/// Dropping it abandons the call in progress and releases the slot, except that a sync call
/// keeps the slot until its job leaves the pool: a queued one is skipped when a thread pops
/// it, a running one finishes on its thread unobserved.
pub struct ResponseFuture {
    inner: BoxFuture<'static, Result<Vec<ToolResult>, DispatchError>>,
}

impl ResponseFuture {
    pub(crate) fn new(
        future: impl Future<Output = Result<Vec<ToolResult>, DispatchError>> + Send + 'static,
    ) -> ResponseFuture {
        ResponseFuture {
            inner: Box::pin(future),
        }
    }
}

impl Future for ResponseFuture {
    type Output = Result<Vec<ToolResult>, DispatchError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
