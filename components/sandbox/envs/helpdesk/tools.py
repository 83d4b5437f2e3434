"""The help-desk's tools over an in-memory state; runs in agentrl's isolated worker (imports: json, re, copy, ...)."""
import copy

STATUSES = ("open", "in_progress", "resolved")


def init(task):
    state = copy.deepcopy(task["payload"]["state"])
    state["touched"] = []
    state["followed_up"] = False
    return state


def _ticket(state, ticket_id):
    if ticket_id not in state["tickets"]:
        raise KeyError(f"no ticket {ticket_id}")
    return state["tickets"][ticket_id]


def _touch(state, ticket_id):
    if ticket_id not in state["touched"]:
        state["touched"].append(ticket_id)


def get_ticket(state, ticket_id):
    t = _ticket(state, ticket_id)
    return {"id": ticket_id, "title": t["title"], "team": t["team"], "status": t["status"], "assignee": t["assignee"]}


def find_agent(state, team):
    for name, agent in sorted(state["agents"].items()):
        if agent["team"] == team and agent["on_call"]:
            return name
    raise KeyError(f"no on-call agent in team {team}")


def assign(state, ticket_id, agent):
    t = _ticket(state, ticket_id)
    if agent not in state["agents"]:
        raise KeyError(f"no agent {agent}")
    t["assignee"] = agent
    _touch(state, ticket_id)
    return "ok"


def set_status(state, ticket_id, status):
    t = _ticket(state, ticket_id)
    if status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}")
    t["status"] = status
    _touch(state, ticket_id)
    return "ok"


def add_comment(state, ticket_id, text):
    _ticket(state, ticket_id)["comments"].append(text)
    _touch(state, ticket_id)
    return "ok"


def user_turn(state, task):
    """The user's follow-up request, once, after the agent says it is done."""
    follow = task["payload"].get("follow_up")
    if follow and not state["followed_up"]:
        state["followed_up"] = True
        return follow["text"]
    return None


def check(state, task):
    expect = dict(task["payload"]["expect"])
    follow = task["payload"].get("follow_up")
    done = []
    for tid, want in expect.items():
        t = state["tickets"][tid]
        for key, value in want.items():
            if (value in t["comments"]) if key == "comment" else t[key] == value:
                done.append(f"{tid}.{key}")
    if follow:
        if state["followed_up"] and follow["comment"] in state["tickets"][follow["ticket"]]["comments"]:
            done.append("follow_up")
    needed = sum(len(w) for w in expect.values()) + (1 if follow else 0)
    others = [t for t in state["touched"] if t not in expect and not (follow and t == follow["ticket"])]
    return {"success": len(done) == needed and not others, "subgoals_done": done,
            "violations": [f"hard: changed ticket {t}, which the request did not name" for t in others]}
