//! The queues a dashboard shows, whatever their backend and row type: [`Queue`] behind a trait
//! object, so one dashboard can hold queues of several databases.
//!
//! The trait returns boxed futures by hand: it must be used as `dyn`, which native async in
//! traits does not allow, and this is the only place that needs it (no `async-trait` for one
//! trait).

use std::future::Future;
use std::pin::Pin;

use broker_core::{
    Backend, Cancelled, DeadLetters, JobInfo, JobState, MetricsSnapshot, Page, Queue, QueueStats,
    Result, TableDescription,
};

/// A boxed future of a queue operation.
pub(crate) type Op<'a, T> = Pin<Box<dyn Future<Output = Result<T>> + Send + 'a>>;

/// What the dashboard calls on a queue: the operations API of `broker_core::Queue`.
pub(crate) trait AnyQueue: Send + Sync {
    fn table(&self) -> &TableDescription;
    fn metrics(&self) -> MetricsSnapshot;
    fn stats(&self) -> Op<'_, QueueStats>;
    fn jobs(&self, state: JobState, page: Page) -> Op<'_, Vec<JobInfo>>;
    fn jobs_of_kind(&self, state: JobState, kind: String, page: Page) -> Op<'_, Vec<JobInfo>>;
    fn job(&self, id: i64) -> Op<'_, Option<JobInfo>>;
    fn requeue_dead(&self, which: DeadLetters) -> Op<'_, u64>;
    fn discard_dead(&self, which: DeadLetters) -> Op<'_, u64>;
    fn cancel(&self, id: i64) -> Op<'_, Cancelled>;
    fn run_now(&self, id: i64) -> Op<'_, ()>;
    fn pause(&self, by: String) -> Op<'_, ()>;
    fn resume(&self) -> Op<'_, ()>;
}

impl<B: Backend, T: 'static> AnyQueue for Queue<B, T> {
    fn table(&self) -> &TableDescription {
        Queue::table(self)
    }
    fn metrics(&self) -> MetricsSnapshot {
        Queue::metrics(self)
    }
    fn stats(&self) -> Op<'_, QueueStats> {
        Box::pin(Queue::stats(self))
    }
    fn jobs(&self, state: JobState, page: Page) -> Op<'_, Vec<JobInfo>> {
        Box::pin(Queue::jobs(self, state, page))
    }
    fn jobs_of_kind(&self, state: JobState, kind: String, page: Page) -> Op<'_, Vec<JobInfo>> {
        Box::pin(async move { Queue::jobs_of_kind(self, state, &kind, page).await })
    }
    fn job(&self, id: i64) -> Op<'_, Option<JobInfo>> {
        Box::pin(Queue::job(self, id))
    }
    fn requeue_dead(&self, which: DeadLetters) -> Op<'_, u64> {
        Box::pin(Queue::requeue_dead(self, which))
    }
    fn discard_dead(&self, which: DeadLetters) -> Op<'_, u64> {
        Box::pin(Queue::discard_dead(self, which))
    }
    fn cancel(&self, id: i64) -> Op<'_, Cancelled> {
        Box::pin(Queue::cancel(self, id))
    }
    fn run_now(&self, id: i64) -> Op<'_, ()> {
        Box::pin(Queue::run_now(self, id))
    }
    fn pause(&self, by: String) -> Op<'_, ()> {
        Box::pin(async move { Queue::pause(self, &by).await })
    }
    fn resume(&self) -> Op<'_, ()> {
        Box::pin(Queue::resume(self))
    }
}
