"""Writes tasks/*.jsonl of the help-desk example (deterministic): `python make_tasks.py` in this folder.

Every reply of the expert is a short thought, then its calls. Five levels: L1 one call; L2 two calls in one reply; L3 a lookup whose answer the next call copies; L4 two lookups,
then two calls; L5 as L2, then the user follows up mid-episode with a comment to add. Every suite has its own
tickets and agents (the held-out suites share no instance with train or practice)."""
import json
import random
from pathlib import Path

TEAMS = ["network", "billing", "mail", "hardware", "access", "printing", "storage", "security"]
NAMES = ["alice", "bruno", "chen", "dana", "emil", "farah", "goran", "hana", "ivan", "jules", "kofi", "lena", "mateo",
         "nora", "omar", "petra", "quinn", "rosa", "sami", "tara", "uma", "viktor", "wen", "yusuf", "zoe"]
TITLES = ["VPN drops every hour", "Invoice total is wrong", "Mailbox is full", "Laptop will not boot",
          "Cannot reach the share", "Printer jams on tray 2", "Disk quota exceeded", "Password reset loops",
          "Badge does not open door 4", "Calendar invites vanish"]
COMMENTS = ["customer called again", "waiting for the vendor", "spare part ordered", "user confirmed the fix",
            "escalated to tier two", "logs attached"]
SIZES = {"train": 200, "practice": 80, "easy": 40, "hard": 60}
LEVELS = {"train": (1, 2, 3, 4, 5), "practice": (1, 2, 3, 4, 5), "easy": (1, 2), "hard": (3, 4, 5)}


def world(rng):
    agents = {n: {"team": rng.choice(TEAMS), "on_call": False} for n in rng.sample(NAMES, 12)}
    for team in TEAMS:  # one on-call agent per team that has agents; a team without gets one
        members = sorted(n for n, a in agents.items() if a["team"] == team)
        if not members:
            spare = rng.choice([n for n in NAMES if n not in agents])
            agents[spare] = {"team": team, "on_call": False}
            members = [spare]
        agents[rng.choice(members)]["on_call"] = True
    tickets = {}
    for _ in range(5):
        tid = f"T-{rng.randrange(100, 1000)}"
        tickets[tid] = {"title": rng.choice(TITLES), "team": rng.choice(TEAMS), "status": "open", "assignee": None,
                        "comments": []}
    return {"agents": agents, "tickets": tickets}


def on_call(state, team):
    return next(n for n, a in sorted(state["agents"].items()) if a["team"] == team and a["on_call"])


def call(name, **arguments):
    return {"name": name, "arguments": arguments}


def step(thought, *calls):
    """One reply: a short thought that restates what the calls copy (a small model copies from a few tokens back),
    then the calls."""
    return {"thought": thought, "calls": list(calls)}


def task(rng, suite, i, level):
    state = world(rng)
    tid = rng.choice(sorted(state["tickets"]))
    agent = rng.choice(sorted(state["agents"]))
    status = rng.choice(["in_progress", "resolved"])
    payload, done = {"state": state}, "Done."  # a reply without a call ends the agent's turn
    if level == 1:
        text = f"Set ticket {tid} to {status}."
        payload["expect"] = {tid: {"status": status}}
        replies = [step(f"I will set {tid} to {status}.", call("set_status", ticket_id=tid, status=status)), done]
    elif level in (2, 5):
        text = f"Assign ticket {tid} to {agent} and set it to {status}."
        payload["expect"] = {tid: {"assignee": agent, "status": status}}
        replies = [step(f"I will assign {tid} to {agent} and set it to {status}.",
                        call("assign", ticket_id=tid, agent=agent), call("set_status", ticket_id=tid, status=status)),
                   done]
        if level == 5:
            note = rng.choice(COMMENTS)
            payload["follow_up"] = {"text": f"Thanks. Also add the comment '{note}' to {tid}.", "ticket": tid,
                                    "comment": note}
            replies += [step(f"I will add '{note}' to {tid}.", call("add_comment", ticket_id=tid, text=note)), done]
    elif level == 3:
        team = rng.choice(TEAMS)
        who = on_call(state, team)
        text = f"Give ticket {tid} to the on-call agent of the {team} team."
        payload["expect"] = {tid: {"assignee": who}}
        replies = [step(f"I need the on-call agent of {team}.", call("find_agent", team=team)),
                   step(f"I will assign {tid} to {who}.", call("assign", ticket_id=tid, agent=who)), done]
    else:
        team = state["tickets"][tid]["team"]
        who = on_call(state, team)
        text = f"Give ticket {tid} to the on-call agent of its own team and set it to {status}."
        payload["expect"] = {tid: {"assignee": who, "status": status}}
        replies = [step(f"I need the team of {tid}.", call("get_ticket", ticket_id=tid)),
                   step(f"I need the on-call agent of {team}.", call("find_agent", team=team)),
                   step(f"I will assign {tid} to {who} and set it to {status}.",
                        call("assign", ticket_id=tid, agent=who), call("set_status", ticket_id=tid, status=status)),
                   done]
    return {"id": f"{suite}-{i:03d}", "instruction": text, "level": level, "scenario": f"L{level}",
            "payload": payload, "solution": replies}


def main():
    out = Path(__file__).parent / "tasks"
    out.mkdir(exist_ok=True)
    for k, (suite, n) in enumerate(SIZES.items()):
        rng = random.Random(1000 + k)
        levels = LEVELS[suite]
        rows = [task(rng, suite, i, levels[i % len(levels)]) for i in range(n)]
        (out / f"{suite}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
