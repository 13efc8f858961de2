//! The in-memory store: the same traits as PgStore, for fast tests and the
//! simulator. A transaction holds the one lock for its whole life (so
//! transactions are serial) and works on a copy that commit installs.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use protocol::manifest::Manifest;
use tokio::sync::{Mutex, OwnedMutexGuard};

use super::{ClientRecord, Store, StoreError, StoreTx};
use crate::config::DependencyAssignment;

/// Everything the store holds.
#[derive(Clone, Debug, Default)]
struct State {
    manifests: Vec<Manifest>,
    clients: BTreeMap<String, ClientRecord>,
    grants: BTreeSet<(String, String)>,
    /// (relation, user_column, value_column) -> rows of (user, value).
    dependencies: BTreeMap<(String, String, String), Vec<(String, String)>>,
}

/// An in-memory database.
#[derive(Clone, Default)]
pub struct MemStore {
    state: Arc<Mutex<State>>,
}

impl MemStore {
    /// An empty store.
    pub fn new() -> MemStore {
        MemStore::default()
    }

    /// Adds a row to `synchro.scope_grants` (what an operator's SQL would do).
    pub async fn grant(&self, user_id: &str, scope_id: &str) {
        self.state
            .lock()
            .await
            .grants
            .insert((user_id.into(), scope_id.into()));
    }

    /// Removes a grant.
    pub async fn revoke(&self, user_id: &str, scope_id: &str) {
        self.state
            .lock()
            .await
            .grants
            .remove(&(user_id.into(), scope_id.into()));
    }

    /// Adds or removes one row of a dependency relation (what the application's SQL would do).
    pub async fn dependency_row(
        &self,
        source: &DependencyAssignment,
        user_id: &str,
        value: &str,
        on: bool,
    ) {
        let key = (
            source.relation.clone(),
            source.user_column.clone(),
            source.value_column.clone(),
        );
        let mut state = self.state.lock().await;
        let rows = state.dependencies.entry(key).or_default();
        rows.retain(|(u, v)| !(u == user_id && v == value));
        if on {
            rows.push((user_id.into(), value.into()));
        }
    }

    /// Retires a client identity (an operator action).
    pub async fn retire_client(&self, client_id: &str) {
        if let Some(c) = self.state.lock().await.clients.get_mut(client_id) {
            c.retired = true;
        }
    }
}

/// A transaction over a private copy of the state.
pub struct MemTx {
    guard: OwnedMutexGuard<State>,
    work: State,
}

impl Store for MemStore {
    type Tx = MemTx;

    async fn begin(&self) -> Result<MemTx, StoreError> {
        let guard = self.state.clone().lock_owned().await;
        let work = guard.clone();
        Ok(MemTx { guard, work })
    }
}

impl StoreTx for MemTx {
    async fn manifests(&mut self) -> Result<Vec<Manifest>, StoreError> {
        Ok(self.work.manifests.clone())
    }

    async fn insert_manifest(&mut self, m: &Manifest) -> Result<(), StoreError> {
        if self
            .work
            .manifests
            .last()
            .is_some_and(|last| last.schema_version() >= m.schema_version())
        {
            return Err(StoreError::Integrity(
                "manifest versions must increase".into(),
            ));
        }
        self.work.manifests.push(m.clone());
        Ok(())
    }

    async fn lock_client(&mut self, client_id: &str) -> Result<Option<ClientRecord>, StoreError> {
        Ok(self.work.clients.get(client_id).cloned())
    }

    async fn put_client(&mut self, c: &ClientRecord) -> Result<(), StoreError> {
        self.work.clients.insert(c.client_id.clone(), c.clone());
        Ok(())
    }

    async fn grants(&mut self, user_id: &str) -> Result<Vec<String>, StoreError> {
        Ok(self
            .work
            .grants
            .iter()
            .filter(|(u, _)| u == user_id)
            .map(|(_, s)| s.clone())
            .collect())
    }

    async fn dependency_values(
        &mut self,
        source: &DependencyAssignment,
        user_id: &str,
    ) -> Result<Vec<String>, StoreError> {
        let key = (
            source.relation.clone(),
            source.user_column.clone(),
            source.value_column.clone(),
        );
        let rows = self
            .work
            .dependencies
            .get(&key)
            .map(Vec::as_slice)
            .unwrap_or_default();
        Ok(rows
            .iter()
            .filter(|(u, _)| u == user_id)
            .map(|(_, v)| v.clone())
            .collect())
    }

    async fn commit(mut self) -> Result<(), StoreError> {
        *self.guard = std::mem::take(&mut self.work);
        Ok(())
    }
}
