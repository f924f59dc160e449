"""A held-out set of chat prompts written by hand, one by one, as users write them: for measuring acceptance (τ)
on requests that share no template with any training instruction.

The built-in set (eaglex.base.chat_prompts) fills a few dozen templates with a few dozen topics, so its held-out split
still shares templates with training. These prompts come from no template and from no generator; they mix lengths
(one line to several paragraphs), carry code to explain, continue conversations, and include other languages.
Training data generators must exclude them (and anything near them). Each entry is (category, messages): a
conversation ending with a user turn; earlier assistant turns are written here too, as a plausible chat history.

TUNING is a second set written the same way, in the categories a bench measures first (coding, code to explain,
explanations, advice, writing), for choosing an engine's tree (`eaglex tune`): a tree is then never chosen on the
prompts it is measured on, nor on the built-in templates the heads were trained on, where deeper trees pay.
"""
from __future__ import annotations


def _u(text: str) -> dict:
    return {"role": "user", "content": text}


def _a(text: str) -> dict:
    return {"role": "assistant", "content": text}


PROMPTS: tuple[tuple[str, tuple[dict, ...]], ...] = (
    # --- coding
    ("coding", (_u("I need a bash one-liner that finds every .log file under /var/app older than 7 days and "
                   "deletes it. Please explain each flag."),)),
    ("coding", (_u("how do i read a csv in python and get the sum of the 'amount' column without pandas"),)),
    ("coding", (_u("Write a SQL query for a table orders(id, customer_id, total, created_at) that returns the top "
                   "3 customers by total spending in 2023."),)),
    ("coding", (_u("Can you give me a minimal Flask app with one route /health that returns JSON {\"ok\": true}?"),)),
    ("coding", (_u("My React component re-renders every time the parent updates even though its props don't "
                   "change. What are my options?"),)),
    # --- code to explain (code in the prompt)
    ("code-explain", (_u("What does this do?\n\n```python\ndef f(xs):\n    seen = {}\n    for i, x in "
                         "enumerate(xs):\n        if x in seen:\n            return seen[x], i\n        seen[x] = i\n"
                         "    return None\n```"),)),
    ("code-explain", (_u("Why does this JavaScript print 3 three times instead of 0 1 2?\n\nfor (var i = 0; i < 3;"
                         " i++) {\n  setTimeout(() => console.log(i), 0);\n}"),)),
    ("code-explain", (_u("Explain this regex line by line: ^(?=.*[A-Z])(?=.*\\d)[A-Za-z\\d@$!%*?&]{8,}$"),)),
    ("code-explain", (_u("I found this in our codebase and nobody knows what it's for:\n\n```c\nint x = n & (n - 1)"
                         ";\nif (x == 0) { /* ... */ }\n```\nWhat is it checking?"),)),
    ("code-explain", (_u("Is there a bug here?\n\n```python\ndef add_item(item, items=[]):\n    items.append(item)"
                         "\n    return items\n\nprint(add_item(1))\nprint(add_item(2))\n```"),)),
    # --- explanations
    ("explanation", (_u("Why is the sky blue during the day but red at sunset?"),)),
    ("explanation", (_u("What's the difference between a virus and a bacterium, and why don't antibiotics work on "
                        "the flu?"),)),
    ("explanation", (_u("ELI5: how does a refrigerator make things cold if it uses electricity, which makes heat?"),)),
    ("explanation", (_u("What actually happens when I type a URL into my browser and press enter?"),)),
    ("explanation", (_u("Could you explain what an index fund is and why people say it's good for beginners?"),)),
    # --- advice
    ("advice", (_u("My roommate keeps eating my food from the fridge. How do I bring it up without starting a "
                   "fight?"),)),
    ("advice", (_u("I'm 28 and thinking about switching careers from accounting to software development. Is it "
                   "too late, and what would you do first?"),)),
    ("advice", (_u("Any tips for keeping a sourdough starter alive when I only bake once every two weeks?"),)),
    ("advice", (_u("I have a presentation to my whole department on Monday and I get really nervous. What can I "
                   "do this weekend to prepare?"),)),
    # --- writing
    ("writing", (_u("Write a polite email to my landlord asking to fix the heating, which has been broken for a "
                    "week."),)),
    ("writing", (_u("Give me a catchy name and a two-sentence description for a small bakery that only sells "
                    "gluten-free bread."),)),
    ("writing", (_u("Rewrite this to sound more professional: 'hey guys, the meeting is moved to thursday cuz "
                    "half the team is out, pls update ur calendars'"),)),
    ("writing", (_u("Write the opening paragraph of a mystery novel set on a night train through the Alps."),)),
    ("writing", (_u("Draft a short thank-you note to my grandmother for the scarf she knitted me."),)),
    # --- math and reasoning
    ("math", (_u("A shirt costs $40 after a 20% discount. What was the original price? Show your steps."),)),
    ("math", (_u("If I have 3 red socks and 5 blue socks in a drawer and pull out two without looking, what's the "
                 "probability they match?"),)),
    ("math", (_u("Solve for x: 3(x - 4) + 7 = 2x + 5"),)),
    ("math", (_u("A train leaves at 2:15 pm and travels 180 km at 72 km/h. When does it arrive?"),)),
    ("math", (_u("Is 391 a prime number? Explain how you checked."),)),
    # --- long inputs (several paragraphs)
    ("long", (_u("Please summarize the following in three bullet points.\n\nOur team spent the last quarter "
                 "migrating the billing service from a single large database to a set of smaller ones, one per "
                 "region. The main motivation was latency: customers in Asia were waiting almost two seconds for "
                 "invoices to load, because every query crossed an ocean.\n\nThe migration itself went mostly to "
                 "plan. We copied historical data in batches over six weekends and ran both systems in parallel "
                 "for a month, comparing every invoice they produced. We found eleven discrepancies, all caused "
                 "by rounding in currency conversion, and fixed them before the switch.\n\nThe results are good "
                 "but not perfect. Median invoice load time in Asia dropped from 1.9 seconds to 0.3 seconds. "
                 "However, reports that span all regions are now slower, since they must query every database "
                 "and merge the results, and the finance team has asked us to fix that next quarter."),)),
    ("long", (_u("Here is a cover letter I wrote. Can you point out the three weakest sentences and suggest "
                 "better versions?\n\nDear Hiring Manager,\n\nI am writing to apply for the position of junior data "
                 "analyst at your company. I think I would be good at this job because I like numbers and I am a "
                 "hard worker. In my last job at a grocery store I was responsible for counting the inventory "
                 "every week and I never made a mistake that I know of.\n\nI recently finished an online course "
                 "in SQL and Python and did a project where I analyzed bike rental data from my city. I found that "
                 "rentals drop by about 40 percent when it rains, which was interesting.\n\nI hope you will "
                 "consider me. Thank you for your time.\n\nSincerely,\nJordan"),)),
    ("long", (_u("I'm trying to decide between two apartments and I keep going back and forth.\n\nThe first one "
                 "is in the city center. It's small, about 45 square meters, on the fourth floor with no elevator, "
                 "and costs 1,100 a month. I could walk to work in ten minutes and there are lots of restaurants "
                 "and a gym nearby.\n\nThe second one is in a suburb, 70 square meters with a balcony and a "
                 "parking spot, for 950 a month. My commute would be 40 minutes by train each way, but the area is "
                 "quiet and there's a big park next to it. I have a dog, if that matters.\n\nWhich would you pick "
                 "and why?"),)),
    ("long", (_u("Read this error log and tell me what most likely went wrong:\n\n2024-03-02 10:14:01 INFO  "
                 "Starting worker pool (size=8)\n2024-03-02 10:14:01 INFO  Connected to queue 'jobs'\n2024-03-02 "
                 "10:16:45 WARN  Job 4411 took 142s (limit 120s)\n2024-03-02 10:16:45 WARN  Job 4412 took 139s "
                 "(limit 120s)\n2024-03-02 10:17:02 ERROR Worker 3 killed: out of memory (rss=3.9GB, limit=4GB)\n"
                 "2024-03-02 10:17:02 ERROR Worker 5 killed: out of memory (rss=4.0GB, limit=4GB)\n2024-03-02 "
                 "10:17:03 INFO  Restarting workers 3, 5\n2024-03-02 10:19:40 ERROR Worker 3 killed: out of memory "
                 "(rss=4.0GB, limit=4GB)\n\nThe jobs are image resizing tasks and this started after we began "
                 "accepting uploads from the new mobile app."),)),
    # --- multi-turn conversations
    ("multi-turn", (_u("What's a good houseplant for a dark apartment?"),
                    _a("A snake plant or a ZZ plant are good choices. Both tolerate low light, need water only "
                       "every two to three weeks, and are hard to kill."),
                    _u("Which of those two is safer if I have a cat?"))),
    ("multi-turn", (_u("could you do me a little haiku on my morning coffee"),
                    _a("Steam curls from the cup,\nbitter warmth against the dawn,\nthe day opens slow."),
                    _u("Nice. Now make it funny."))),
    ("multi-turn", (_u("How do I reverse a list in Python?"),
                    _a("You can use slicing, `my_list[::-1]`, which returns a new reversed list, or "
                       "`my_list.reverse()`, which reverses the list in place and returns None."),
                    _u("And what about a string? Does reverse() work there too?"))),
    ("multi-turn", (_u("I'm planning a 3-day trip to Lisbon in April."),
                    _a("Great choice! April is mild in Lisbon. Would you like suggestions for neighborhoods to "
                       "stay in, things to see, or food to try?"),
                    _u("Things to see, please. I like history and views but hate long queues."))),
    ("multi-turn", (_u("At what temperature does water start to boil?"),
                    _a("At sea level, water boils at 100 degrees Celsius (212 degrees Fahrenheit)."),
                    _u("Why is it lower on a mountain?"),
                    _a("Because air pressure is lower at altitude, so water molecules need less energy to "
                       "escape as vapor."),
                    _u("So does pasta take longer to cook up there? Explain."))),
    # --- other languages
    ("non-english", (_u("Peux-tu m'expliquer simplement la différence entre le climat et la météo ?"),)),
    ("non-english", (_u("¿Cuáles son tres consejos para aprender a programar si nunca lo he hecho antes?"),)),
    ("non-english", (_u("Schreib mir bitte ein kurzes Rezept für Pfannkuchen für vier Personen."),)),
    ("non-english", (_u("Qual é a capital da Austrália e por que não é Sydney?"),)),
)


# Categories interleaved, so that the few prompts tuning measures on cover them all.
TUNING: tuple[tuple[str, tuple[dict, ...]], ...] = (
    ("coding", (_u("write a python function that checks if two strings are anagrams of each other, ignoring spaces "
                   "and case"),)),
    ("explanation", (_u("How do noise-cancelling headphones actually cancel noise?"),)),
    ("code-explain", (_u("What's the difference between these two lines in JavaScript?\n\n```js\nconst a = "
                         "arr.map(x => x * 2);\narr.forEach(x => x * 2);\n```"),)),
    ("advice", (_u("I keep hitting snooze five times every morning and then rushing. How can I actually get up "
                   "on the first alarm?"),)),
    ("writing", (_u("Write a short, friendly message to my neighbours inviting them to a building barbecue on "
                    "Saturday afternoon in the courtyard."),)),
    ("coding", (_u("In Go, how do I read a file line by line and count how many lines contain the word "
                   "\"error\"?"),)),
    ("explanation", (_u("Why do we have leap years, and why is 1900 not one but 2000 was?"),)),
    ("code-explain", (_u("Can someone explain what this shell command does before I run it?\n\n"
                         "find . -name '*.tmp' -print0 | xargs -0 rm -f"),)),
    ("advice", (_u("My manager gives me feedback only in front of the whole team and it's embarrassing. Should I "
                   "say something, and how?"),)),
    ("writing", (_u("Give me three taglines for a bike repair shop that also serves coffee."),)),
    ("coding", (_u("What's the cleanest way to merge two dictionaries in Python 3 so that values from the second "
                   "one win?"),)),
    ("explanation", (_u("In simple terms, what is inflation and who does it hurt the most?"),)),
    ("code-explain", (_u("What does this SQL return, and is the GROUP BY right?\n\n```sql\nSELECT department, "
                         "COUNT(*)\nFROM employees\nWHERE salary > 50000\nGROUP BY department\nHAVING COUNT(*) > 3"
                         ";\n```"),)),
    ("advice", (_u("I want to start running but I get bored after ten minutes. Any ideas to make it stick?"),)),
    ("writing", (_u("Write a product description for a handmade ceramic mug, about 60 words, warm but not "
                    "cheesy."),)),
    ("coding", (_u("How can I make a simple countdown timer in the browser with plain HTML and JavaScript, no "
                   "libraries?"),)),
)


def honest_prompts() -> list[tuple[str, list[dict]]]:
    """(category, conversation) for every prompt, in a fixed order."""
    return [(cat, [dict(m) for m in msgs]) for cat, msgs in PROMPTS]


def tuning_prompts() -> list[tuple[str, list[dict]]]:
    """(category, conversation) for every prompt of the tuning set, in a fixed order."""
    return [(cat, [dict(m) for m in msgs]) for cat, msgs in TUNING]


def user_texts() -> list[str]:
    """Every user turn of both sets: what training data must not contain (nor anything near it)."""
    return [m["content"] for _, msgs in PROMPTS + TUNING for m in msgs if m["role"] == "user"]
