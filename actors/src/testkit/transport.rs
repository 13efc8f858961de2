//! How a suite's clients reach the engine under test: by calling it, or
//! through a server the test started in front of it (HTTP in the server's
//! tests). The suites are written once against [`Node`], and each store
//! and each transport runs all of them.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::Engine;
use crate::reply::Reply;

/// A sync endpoint a test client calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Connect,
    Push,
    Pull,
    Rebuild,
}

impl Route {
    /// The endpoint's path.
    pub fn path(self) -> &'static str {
        match self {
            Route::Connect => "/sync/connect",
            Route::Push => "/sync/push",
            Route::Pull => "/sync/pull",
            Route::Rebuild => "/sync/rebuild",
        }
    }
}

/// The answer of one request, in the making.
pub type Answer = Pin<Box<dyn Future<Output = Reply> + Send>>;

/// Sends one request as an authenticated user: (route, user, body).
#[derive(Clone)]
pub struct Transport(Arc<dyn Fn(Route, String, Vec<u8>) -> Answer + Send + Sync>);

impl Transport {
    /// A transport from `send`.
    pub fn new(send: impl Fn(Route, String, Vec<u8>) -> Answer + Send + Sync + 'static) -> Self {
        Transport(Arc::new(send))
    }

    /// Calls the engine itself, at the testkit's fixed time.
    pub fn direct(engine: &Engine) -> Transport {
        let engine = engine.clone();
        Transport::new(move |route, user, body| {
            let engine = engine.clone();
            Box::pin(async move {
                match route {
                    Route::Connect => engine.connect(&user, body, super::NOW).await,
                    Route::Push => engine.push(&user, body, super::NOW).await,
                    Route::Pull => engine.pull(&user, body, super::NOW).await,
                    Route::Rebuild => engine.rebuild(&user, body, super::NOW).await,
                }
            })
        })
    }

    /// Sends `body` to `route` as `user`.
    pub async fn send(&self, route: Route, user: &str, body: Vec<u8>) -> Reply {
        (self.0)(route, user.to_owned(), body).await
    }
}

/// Puts a transport in front of each engine a suite starts.
pub type Serve = Arc<dyn Fn(&Engine) -> Transport + Send + Sync>;

/// An engine under test and the way its clients reach it.
#[derive(Clone)]
pub struct Node {
    pub engine: Engine,
    pub transport: Transport,
    serve: Serve,
}

impl Node {
    /// `engine`, reached through `serve`'s transport.
    pub fn new(engine: Engine, serve: Serve) -> Node {
        Node {
            transport: serve(&engine),
            engine,
            serve,
        }
    }

    /// Another engine (a restart with a new configuration), reached the same way.
    pub fn with(&self, engine: Engine) -> Node {
        Node::new(engine, self.serve.clone())
    }

    /// Sends `body` to `route` as `user`.
    pub async fn send(&self, route: Route, user: &str, body: Vec<u8>) -> Reply {
        self.transport.send(route, user, body).await
    }
}

impl From<&Engine> for Node {
    /// The engine, called directly.
    fn from(engine: &Engine) -> Node {
        Node::new(engine.clone(), Arc::new(Transport::direct))
    }
}

impl From<&Node> for Node {
    fn from(node: &Node) -> Node {
        node.clone()
    }
}
