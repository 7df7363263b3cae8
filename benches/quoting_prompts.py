"""Chat prompts that quote their input (rewrite, summarize, fix typos, extract fields, edit code): the work where
n-gram (prompt-lookup) proposals pay, since the answer repeats spans of the prompt. The passages are written for
this bench; `conversations()` pairs each with an instruction."""

from __future__ import annotations

LIBRARY = """\
The town library on Mill Street will close for renovation from the first of March until the end of August. During
those six months the building will get a new roof, a lift to the first floor, and wiring that can carry the
charging points readers have asked for since 2019. The children's room will move from the basement to the
ground floor, where the windows face the park, and the old reading room upstairs will be split into four quiet
rooms that groups can book for two hours at a time. While the building is closed, a smaller branch will open in
the community hall on Station Road. It will lend books, print documents and offer internet access on weekday
afternoons and on Saturday mornings. Books that are already on loan can be returned there or at any other library
in the county, and no late fees will be charged until the main building reopens. The renovation costs 1.4 million
pounds, of which the county council pays two thirds and a local trust the rest. Anyone who wants to help choose
the furniture for the new children's room can join a meeting at the community hall on the twelfth of February at
seven in the evening."""

BRIDGE = """\
Engineers inspected the river bridge last week and found that two of the steel bearings under the eastern span
have worn further than expected. The bearings let the deck move a little as it warms in summer and cools in
winter; when they wear, the deck pushes against the concrete piers instead, and small cracks start to appear.
The cracks found so far are shallow and the bridge is safe to use, but the engineers recommend replacing both
bearings before next winter. The work needs the eastern span to be lifted by a few millimetres with hydraulic
jacks, so the bridge will be closed to lorries and buses for three weekends in September. Cars, cyclists and
people on foot will still be able to cross on one lane, controlled by temporary traffic lights. Buses will take
the longer route through the industrial estate, which adds about ten minutes to a journey into the town centre.
The council expects the work to cost around 380,000 pounds and to be finished by the middle of October. A full
report, with photographs of the bearings and the cracks, will be published on the council's website next month."""

GARDEN = """\
The community garden behind the primary school started six years ago as a few raised beds and a water butt. It
now has forty beds, a greenhouse built from recycled windows, and a small orchard of apple and plum trees that
gave more than two hundred kilograms of fruit last autumn. About sixty households hold a bed each, and the school
keeps eight beds for its classes, where children grow beans, potatoes and sunflowers and weigh what they harvest.
Members pay ten pounds a year, which buys seeds, compost and tools that everyone shares. The garden has a waiting
list of twenty names, so the committee plans to turn the unused corner by the fence into twelve more beds this
spring. Volunteers meet on the first Sunday of every month to mend paths, turn the compost heaps and prune the
trees. Nobody needs experience: the older members are glad to teach, and there is always tea."""

MEETING = """\
Minutes of the residents' association meeting held on Tuesday the fourth of November in the hall of Saint Anne's
church. Present were eighteen members; the chair, Margaret Okafor, opened the meeting at half past seven. The
treasurer, David Lindqvist, reported a balance of 2,316 pounds after paying for the summer fair, which raised
845 pounds for the playground fund. Members agreed to spend up to 600 pounds on two new benches for the green on
Elm Avenue, to be ordered by the end of the month. Priya Raman reported that the council has promised to repair
the streetlights on Orchard Lane by the fifteenth of December, after three complaints from residents. The
association will write to the bus company about the early morning service, which has been cancelled eleven
times since September. The next meeting will be held on Tuesday the second of December at the same place and
time. The meeting closed at a quarter to nine."""

TYPO_NOTICE = """\
Dear residents, we are writting to let you know that the water supply to your street will be turned of on
Thursday between nine in the morning and four in the afternon. Our engineers need to replace a section of the
main pipe that has been leaking since the begining of the month. We recomend that you fill a few bottles with
water the night before, and that you do not use your washing machine or dishwasher untill the supply is back.
When the water comes back it may look cloudy for a short while; this is only air in the pipes and it is safe to
drink. If the water is still cloudy after an hour, or if it looks brown, please call our helpline and we will
send someone to check. We apologise for the inconvenience and thank you for you're patience."""

TYPO_RECIPE = """\
To make the bread, mix five hundred grams of strong white flour with a teaspoon of salt and a sachet of dried
yeast in a large bowl. Add three hundred mililitres of warm water and two tablespoons of olive oil, and stir
untill the dough comes together. Tip it out onto a floured surface and knead it for ten minutes, untill it is
smooth and springy. Put it back in the bowl, cover it with a damp towel and leave it somewhere warm for an hour,
or untill it has doubled in size. Knock the air out of the dough, shape it into a loaf and place it on a baking
tray. Leave it to rise for another fourty minutes while the oven heats to two hundred and twenty degrees. Bake
the loaf for thirty minutes, untill it is golden and sounds hollow when you tap the bottom, and let it cool
before you slice it."""

TYPO_SHORT = """\
The meeting has been moved to Wendesday becuase the hall is being painted; plaese bring you're own chairs."""

MOVING_AVERAGE = """\
def moving_average(xs, window):
    if window < 1:
        raise ValueError("window must be at least 1")
    out = []
    total = 0.0
    for i, x in enumerate(xs):
        total += x
        if i >= window:
            total -= xs[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out


def smooth_series(series, window=3):
    result = {}
    for name, xs in series.items():
        if len(xs) < window:
            result[name] = list(xs)
        else:
            result[name] = moving_average(xs, window)
    return result"""

INVENTORY = """\
def merge_inventory(current, delivered, sold):
    stock = dict(current)
    for item, count in delivered.items():
        stock[item] = stock.get(item, 0) + count
    for item, count in sold.items():
        if stock.get(item, 0) < count:
            raise ValueError(f"sold {count} of {item} but only {stock.get(item, 0)} in stock")
        stock[item] -= count
    low = [item for item, count in stock.items() if count < 5]
    return stock, sorted(low)


def reorder_list(stock, minimum, pack_size):
    orders = {}
    for item, count in stock.items():
        if count < minimum:
            missing = minimum - count
            packs = (missing + pack_size - 1) // pack_size
            orders[item] = packs * pack_size
    return orders"""

SOURCES = {"library": LIBRARY, "bridge": BRIDGE, "garden": GARDEN, "meeting": MEETING, "typo_notice": TYPO_NOTICE,
           "typo_recipe": TYPO_RECIPE, "typo_short": TYPO_SHORT, "moving_average": MOVING_AVERAGE,
           "inventory": INVENTORY}

FIX_TYPOS = "Fix the spelling mistakes in the following text. Return the whole corrected text and nothing else."
EXTRACT = ("From the text below, extract every person's name with their role, every date and every amount of "
           "money. Write one per line as 'field: value'.")

# (name, sources, instruction): the instruction comes first, then the sources ("a+b": two of them) quoted in full;
# the first four are of mixed lengths, for short runs
TASKS = (
    ("rewrite_library", "library", "Rewrite the following paragraph in plain, simple English, keeping every fact."),
    ("fix_typos_short", "typo_short", FIX_TYPOS),
    ("rename_moving_average", "moving_average",
     "In this Python code, rename the variable `xs` to `values` everywhere. Return the whole code."),
    ("summarize_library_garden", "library+garden", "Summarize each of the two passages below in two sentences."),
    ("fix_typos_notice", "typo_notice", FIX_TYPOS),
    ("summarize_bridge", "bridge", "Summarize the following report in three sentences."),
    ("extract_meeting", "meeting", EXTRACT),
    ("docstring_inventory", "inventory",
     "Add a one-line docstring to each function in this Python code. Return the whole code."),
    ("paraphrase_garden", "garden", "Paraphrase the following paragraph, sentence by sentence."),
    ("fix_typos_recipe", "typo_recipe", FIX_TYPOS),
    ("summarize_library", "library", "Summarize the following notice in two sentences for a newsletter."),
    ("docstring_moving_average", "moving_average",
     "Add a docstring to each function in this Python code that says what it returns. Return the whole code."),
    ("rewrite_meeting", "meeting", "Rewrite these minutes as a short email to the members who were absent."),
    ("rename_inventory", "inventory",
     "In this Python code, rename the variable `stock` to `inventory` everywhere. Return the whole code."),
    ("rewrite_bridge", "bridge", "Rewrite the following report for a local radio bulletin, keeping every fact."),
    ("extract_library", "library", EXTRACT),
    ("summarize_garden", "garden", "Summarize the following paragraph in one sentence."),
    ("type_hints_inventory", "inventory",
     "Add type hints to every function in this Python code. Return the whole code."),
    ("past_tense_bridge", "bridge", "Rewrite the following report in the past tense, changing nothing else."),
    ("extract_typo_notice", "typo_notice", "List the times and the things residents are asked to do, from this "
                                           "text, one per line."),
    ("rewrite_bridge_meeting", "bridge+meeting", "Rewrite both texts below in plain, simple English, one after "
                                                 "the other, keeping every fact."),
)


def quoted(sources: str) -> str:
    """The sources ("a" or "a+b") as the prompt quotes them: code in a fenced block, prose as it is, a blank line
    between two."""
    texts = [SOURCES[name] for name in sources.split("+")]
    return "\n\n".join(f"```python\n{t}\n```" if t.startswith("def ") else t for t in texts)


def conversations(num_prompts: int = len(TASKS)) -> list[tuple[str, list[dict]]]:
    """The first `num_prompts` tasks as (name, one-message conversation): the instruction, a blank line, then the
    source quoted in full."""
    if not 1 <= num_prompts <= len(TASKS):
        raise ValueError(f"num_prompts {num_prompts} is outside 1..{len(TASKS)}, the number of tasks written")
    return [(name, [{"role": "user", "content": f"{instruction}\n\n{quoted(source)}"}])
            for name, source, instruction in TASKS[:num_prompts]]
