-- A small notes app: per-user notes, public templates, and notes shared with teams.
CREATE TABLE IF NOT EXISTS public.notes (
    id          uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    owner_id    text NOT NULL,
    title       text NOT NULL,
    body        text,
    pinned      boolean NOT NULL DEFAULT false,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    deleted_at  timestamptz
);

CREATE TABLE IF NOT EXISTS public.templates (
    id    text PRIMARY KEY,
    name  text NOT NULL,
    body  text NOT NULL
);

-- Not synced: they decide membership and assignment.
CREATE TABLE IF NOT EXISTS public.team_members (
    user_id  text NOT NULL,
    team_id  text NOT NULL,
    PRIMARY KEY (user_id, team_id)
);

CREATE TABLE IF NOT EXISTS public.note_shares (
    note_id  uuid NOT NULL REFERENCES public.notes (id) ON DELETE CASCADE,
    team_id  text NOT NULL,
    PRIMARY KEY (note_id, team_id)
);
