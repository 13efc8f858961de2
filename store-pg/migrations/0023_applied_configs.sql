-- Issue 23: a process of an older deploy, restarted, must not bring its
-- config back over a newer one (ADR 0020 §8). Each config a process
-- started with, by its fingerprint, once, in the order it was last applied.
CREATE SEQUENCE synchro.applied_configs_order;
CREATE TABLE synchro.applied_configs (
    fingerprint text PRIMARY KEY,
    applied_order bigint NOT NULL DEFAULT nextval('synchro.applied_configs_order')
);
