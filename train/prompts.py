"""Self-written training prompts: topics x task types, from templates and a seeded RNG.

Two streams, interleaved three to one, each prefix-stable in n so a larger run only adds
prompts: the first (ids `s<seed>-k`) has chat, explanation, code, math (word problems with
fresh numbers), list, story, translation, letter, compare, advice and `passage` prompts; the
second (ids `r<seed>-k`) widens the styles: roleplay, reasoning puzzles, short factual
questions, essays, structured output, reading and fixing code, multi-step arithmetic. Answers to
`passage` prompts (text the target writes itself) become the material of summarize / rewrite /
extract / question prompts, and joined three at a time, of long-document and several-document
prompts (`passage_tasks`). A third stream (`document_prompts`, ids `w<seed>-k`) asks only for
passages, in many genres (news, reports, emails, reviews, guides), whose answers become document
tasks over two to five joined passages; `back_translation_tasks` asks to translate the target's
own translations back into English. Nothing here is taken from any benchmark; `train.decontam`
checks that.

    generate_prompts(n, seed) -> [{"id", "kind", "messages": [{"role": "user", "content"}]}]
"""

from __future__ import annotations

import random
import zlib

TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "volcanoes", "honey bees", "the immune system",
    "climate change", "renewable energy", "solar panels", "electric cars", "the printing press",
    "the Roman Empire", "ancient Egypt", "the Silk Road", "the Industrial Revolution", "the moon landing",
    "machine learning", "the internet", "databases", "computer networks", "encryption", "cloud computing",
    "open source software", "video games", "smartphones", "social media", "3D printing", "robots",
    "coffee", "tea ceremonies", "baking bread", "vegetarian cooking", "fermentation", "spices",
    "running", "yoga", "chess", "football", "swimming", "mountain hiking", "cycling", "sleep",
    "meditation", "time management", "public speaking", "learning a language", "saving money",
    "budgeting", "starting a small business", "remote work", "job interviews", "teamwork",
    "gardening", "house plants", "composting", "bird watching", "dogs", "cats", "dolphins", "elephants",
    "rain forests", "deserts", "oceans", "coral reefs", "glaciers", "earthquakes", "hurricanes",
    "the solar system", "Mars", "telescopes", "gravity", "electricity", "magnets", "light",
    "sound waves", "atoms", "DNA", "vaccines", "bacteria", "nutrition", "vitamins", "the human heart",
    "the brain", "music theory", "jazz", "painting", "photography", "poetry", "libraries", "museums",
    "trains", "airplanes", "bridges", "skyscrapers", "cities", "farming", "recycling", "plastic waste",
    "clean water", "friendship", "kindness", "curiosity", "habits", "board games", "birthdays",
    "winter holidays", "camping", "road trips", "maps", "volunteering", "elections", "money",
    "banks", "inflation", "supply and demand", "the stock market", "insurance", "taxes",
]

PAIRS = [
    ("a virus", "a bacterium"), ("weather", "climate"), ("RAM", "disk storage"), ("a list", "a tuple"),
    ("a lake", "a sea"), ("speed", "velocity"), ("mass", "weight"), ("a comet", "an asteroid"),
    ("TCP", "UDP"), ("a compiler", "an interpreter"), ("stocks", "bonds"), ("a frog", "a toad"),
    ("baking soda", "baking powder"), ("an alligator", "a crocodile"), ("a meteor", "a meteorite"),
    ("HTTP", "HTTPS"), ("a democracy", "a monarchy"), ("a simile", "a metaphor"), ("AC", "DC current"),
    ("a hurricane", "a tornado"), ("a violin", "a cello"), ("git merge", "git rebase"), ("SQL", "NoSQL"),
]

AUDIENCES = ["a ten-year-old", "a beginner", "a high school student", "a busy manager", "my grandmother",
             "a new employee", "someone who has never heard of it", "a curious teenager"]

CHAT = [
    "Hi! How are you today?", "Can you recommend a good book for a rainy weekend?",
    "What should I cook for dinner tonight? I have rice, eggs and some vegetables.",
    "I feel a bit bored. Any ideas for something fun to do at home?",
    "What is your favorite season and why?", "Tell me a fun fact about {topic}.",
    "I want to get better at {topic}. Where should I start?", "Why do people enjoy {topic}?",
    "Can you give me some motivation to finish my homework?", "What are good questions to ask on a first day at a new job?",
    "Do you have any tips for staying focused while studying?", "What is a good name for a pet goldfish?",
    "How can I make new friends after moving to a new city?", "I'm nervous about my exam tomorrow. Any advice?",
    "What would be a fun theme for a birthday party?", "Tell me something interesting about {topic}.",
    "Hello! Can you help me plan my weekend?", "What is the best way to start learning about {topic}?",
]

EXPLAIN = [
    "Explain {topic} to {audience}.", "What is {topic}? Give a short explanation.",
    "How does {topic} work?", "Describe the main ideas behind {topic}.",
    "Why is {topic} important?", "Give a simple explanation of {topic} with one example.",
    "What are the most common misconceptions about {topic}?", "Write a short paragraph explaining {topic}.",
    "What is the history of {topic} in a few sentences?", "Explain the basics of {topic} step by step.",
]

COMPARE = [
    "What is the difference between {a} and {b}?", "Compare {a} and {b} in a short paragraph.",
    "Explain how {a} differs from {b}, with an example of each.", "Is {a} the same as {b}? Explain briefly.",
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "returns the n-th Fibonacci number", "counts the vowels in a string", "finds the largest element of a list",
    "removes duplicates from a list while keeping order", "checks whether a word is a palindrome",
    "sorts a list of numbers with bubble sort", "merges two sorted lists", "counts word frequencies in a text",
    "converts Celsius to Fahrenheit", "computes the greatest common divisor of two integers",
    "flattens a nested list", "returns the sum of the digits of an integer", "implements binary search",
    "reads a text file and prints the number of lines", "validates a simple email address",
    "transposes a matrix", "generates all subsets of a list", "implements a stack with push and pop",
    "finds the second smallest number in a list", "capitalizes the first letter of every word",
    "checks whether two strings are anagrams", "computes the average of a list, ignoring None values",
    "converts a Roman numeral to an integer", "rotates a list by k positions", "implements a simple queue",
]
LANGS = ["Python", "Python", "Python", "JavaScript", "Java", "C++", "Go", "Rust", "C", "TypeScript"]
CODE = [
    "Write a {lang} function that {task}.", "Write {lang} code that {task}, and explain it briefly.",
    "How would I write a function in {lang} that {task}?", "Show a short {lang} example of a function that {task}.",
    "Write a {lang} program that {task}. Add comments.",
]
CODE_OTHER = [
    "Explain what a {concept} is in programming, with a small {lang} example.",
    "What are the advantages of using a {concept}?", "When should I use a {concept} in {lang}?",
]
CONCEPTS = ["hash map", "linked list", "class", "closure", "recursive function", "loop", "decorator", "unit test",
            "binary tree", "regular expression", "exception", "generator", "interface", "pointer", "thread"]

NAMES = ["Anna", "Ben", "Carlos", "Dina", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jack", "Lena", "Omar", "Priya",
         "Sam", "Tom", "Yuki", "Zoe", "Mia", "Noah", "Leo"]
ITEMS = [("apples", 1, 3), ("pencils", 1, 2), ("books", 5, 15), ("tickets", 8, 30), ("cupcakes", 2, 4),
         ("notebooks", 2, 6), ("stickers", 1, 1), ("bottles of water", 1, 2), ("marbles", 1, 1), ("shirts", 10, 25)]


def _math(rng: random.Random) -> str:
    name, other = rng.sample(NAMES, 2)
    item, lo, hi = rng.choice(ITEMS)
    a, b, c = rng.randint(3, 40), rng.randint(2, 15), rng.randint(2, 9)
    price = rng.randint(lo, hi)
    forms = [
        f"{name} has {a} {item}. {other} gives {name} {b} more, and then {name} gives away {c}. How many {item} does {name} have now?",
        f"Each of the {item} costs ${price}. {name} buys {b} of them and pays with a ${price * b + rng.randint(1, 20)} bill. How much change does {name} get?",
        f"A class has {a + 10} students. {b} of them are absent today. The rest are split into groups of {c}. How many full groups are there, and how many students are left over?",
        f"{name} reads {b} pages every day. The book has {a * 10} pages. How many days does it take to finish the book?",
        f"A train travels at {a + 40} km per hour for {c} hours. How far does it go?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        f"{name} saves ${b} every week. How many weeks will it take to save ${b * a}?",
        f"There are {a} {item} in a box. {name} takes {c} and {other} takes twice as many. How many are left in the box?",
        f"If {c} workers can paint a fence in {b * 2} hours, how long would it take {c * 2} workers at the same rate?",
        f"What is {rng.randint(11, 99)} percent of {rng.randint(2, 50) * 20}? Show your work.",
        f"Solve for x: {c}x + {b} = {c * a + b}.",
        f"{name} is {a} years old. {other} is {b} years older. How old will {other} be in {c} years?",
        f"A recipe needs {c} cups of flour for {b} cookies. How much flour is needed for {b * c} cookies?",
        f"The sum of two numbers is {a + b}, and their difference is {abs(a - b)}. What are the two numbers?",
    ]
    text = rng.choice(forms)
    return text + rng.choice(["", " Explain step by step.", " Show your reasoning.", ""])


LIST = [
    "List {n} tips for {topic}.", "Give me {n} interesting facts about {topic}.",
    "What are {n} benefits of {topic}?", "Name {n} things everyone should know about {topic}.",
    "Make a checklist of {n} steps to get started with {topic}.", "List {n} pros and cons of {topic}.",
    "Suggest {n} ideas for a school project about {topic}.", "What are {n} common mistakes people make with {topic}?",
]

STORY_WHO = ["a young wizard", "a lost robot", "a brave little mouse", "an old fisherman", "a curious girl",
             "a dragon who is afraid of fire", "two best friends", "a talking tree", "a detective cat",
             "a space explorer", "a shy baker", "a pirate who cannot swim", "a grandmother and her grandson"]
STORY_WHERE = ["in a small village", "on a distant planet", "in a big city", "under the sea", "in a magic forest",
               "on a train", "in a snowy mountain town", "at a busy market", "in a castle", "on an island"]
STORY = [
    "Write a short story about {who} {where}.", "Tell me a bedtime story about {who}.",
    "Write a poem about {topic}.", "Write a haiku about {topic}.", "Write a short funny story about {who} {where}.",
    "Write the opening paragraph of an adventure story about {who}.", "Write a limerick about {who}.",
    "Write a short dialogue between {who} and {who2}.", "Write a four-line poem about {topic}.",
]

LETTER = [
    "Write a short email to my team announcing a meeting about {topic} next Monday.",
    "Write a thank-you note to a friend who helped me move.", "Write a polite email asking my landlord to fix the heating.",
    "Write a short product description for a new {product}.", "Write a tweet announcing a workshop about {topic}.",
    "Write a short speech to welcome new members to a {topic} club.", "Write an invitation to a {topic} party.",
    "Write a short review of an imaginary {product}.", "Write a cover letter opening for a job at a {topic} company.",
]
PRODUCTS = ["water bottle", "backpack", "desk lamp", "coffee maker", "pair of running shoes", "phone case", "notebook",
            "bicycle helmet", "electric toothbrush", "board game"]

ADVICE = [
    "How can I improve my {skill}?", "What is a good daily routine for {goal}?", "How do I {goal}?",
    "Give me a simple plan to {goal} in one month.", "What should I consider before {decision}?",
]
SKILLS = ["writing", "memory", "handwriting", "sleep", "cooking", "math skills", "listening skills", "posture", "focus"]
GOALS = ["learn to cook", "get fit", "read more books", "learn to play guitar", "save for a vacation",
         "keep my room tidy", "drink more water", "learn to draw", "wake up earlier", "reduce screen time"]
DECISIONS = ["buying a car", "adopting a dog", "moving abroad", "changing careers", "starting a blog", "buying a laptop"]

SENTENCE_SUBJ = ["My brother", "The teacher", "Our neighbors", "The little girl", "My friend", "The old man", "We", "They"]
SENTENCE_VERB = ["likes to visit", "went to", "is going to", "often talks about", "wants to see", "forgot about",
                 "was happy about", "will write about"]
SENTENCE_OBJ = ["the market on Saturday", "the museum in the city", "the new library", "the beach last summer",
                "a small cafe near the station", "the football match", "her garden", "the history exam",
                "the park after school", "the birthday party"]
TRANSLATE_TO = ["French", "Spanish", "German", "Italian", "Portuguese", "Chinese", "Japanese", "Dutch", "Russian"]
TRANSLATE = [
    "Translate into {lang}: \"{text}\"", "How do you say \"{text}\" in {lang}?",
    "Translate this sentence to {lang}: {text}", "Please translate the following into {lang}.\n{text}",
]

PASSAGE = [
    "Write a short paragraph about {topic}.", "Write a short news report about a local event related to {topic}.",
    "Write a short blog post about {topic}.", "Write a brief description of {topic} for an encyclopedia.",
]

KINDS = [("chat", 10), ("explanation", 16), ("compare", 5), ("code", 14), ("math", 12), ("list", 9), ("story", 9),
         ("letter", 6), ("advice", 6), ("translation", 7), ("passage", 6)]


def _fill(rng: random.Random, kind: str) -> str:
    topic = rng.choice(TOPICS)
    if kind == "chat":
        return rng.choice(CHAT).format(topic=topic)
    if kind == "explanation":
        return rng.choice(EXPLAIN).format(topic=topic, audience=rng.choice(AUDIENCES))
    if kind == "compare":
        a, b = rng.choice(PAIRS)
        return rng.choice(COMPARE).format(a=a, b=b)
    if kind == "code":
        if rng.random() < 0.75:
            return rng.choice(CODE).format(lang=rng.choice(LANGS), task=rng.choice(CODE_TASKS))
        return rng.choice(CODE_OTHER).format(concept=rng.choice(CONCEPTS), lang=rng.choice(LANGS))
    if kind == "math":
        return _math(rng)
    if kind == "list":
        return rng.choice(LIST).format(n=rng.choice([3, 4, 5, 5, 6, 7]), topic=topic)
    if kind == "story":
        who, who2 = rng.sample(STORY_WHO, 2)
        return rng.choice(STORY).format(who=who, who2=who2, where=rng.choice(STORY_WHERE), topic=topic)
    if kind == "letter":
        return rng.choice(LETTER).format(topic=topic, product=rng.choice(PRODUCTS))
    if kind == "advice":
        return rng.choice(ADVICE).format(skill=rng.choice(SKILLS), goal=rng.choice(GOALS), decision=rng.choice(DECISIONS))
    if kind == "translation":
        text = f"{rng.choice(SENTENCE_SUBJ)} {rng.choice(SENTENCE_VERB)} {rng.choice(SENTENCE_OBJ)}."
        return rng.choice(TRANSLATE).format(lang=rng.choice(TRANSLATE_TO), text=text)
    if kind == "passage":
        return rng.choice(PASSAGE).format(topic=topic)
    raise ValueError(kind)


PERSONAS = ["a pirate captain", "a medieval knight", "a friendly librarian", "a sports coach", "a tour guide in Rome",
            "a chef at a busy restaurant", "a detective in the 1920s", "an astronaut on the space station",
            "a wise old teacher", "a travel agent", "a museum guide", "a park ranger", "a shop owner", "a doctor",
            "a robot learning about humans", "a news reporter", "a famous painter", "a customer support agent"]
ROLEPLAY = [
    "Pretend you are {persona}. Describe a typical day in your life.",
    "You are {persona}. A visitor asks you about {topic}. What do you say?",
    "Act as {persona} and give me advice about {topic}.", "Stay in character as {persona} and greet a new customer.",
    "Imagine you are {persona}. Tell me about the hardest moment of your career.",
    "Play the role of {persona} explaining {topic} to {audience}.",
]


def _reasoning(rng: random.Random) -> str:
    a, b, c = rng.sample(NAMES, 3)
    trait = rng.choice([("taller", "shortest"), ("older", "youngest"), ("faster", "slowest"), ("richer", "poorest")])
    day = rng.choice(["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"])
    k = rng.randint(2, 20)
    thing, group, prop = rng.choice([("roses", "flowers", "need water"), ("sparrows", "birds", "have feathers"),
                                     ("oaks", "trees", "have roots"), ("cars", "vehicles", "need fuel or power"),
                                     ("squares", "rectangles", "have four right angles")])
    forms = [
        f"{a} is {trait[0]} than {b}, and {b} is {trait[0]} than {c}. Who is the {trait[1]}? Explain your reasoning.",
        f"If today is {day}, what day of the week will it be in {k} days? Think it through.",
        f"All {thing} are {group}, and all {group} {prop}. Do all {thing} {prop}? Explain the logic.",
        f"{a}, {b} and {c} each have a different pet: a cat, a dog and a fish. {a} is allergic to fur, and {b} "
        f"walks their pet every morning. Who has which pet?",
        f"A box has {k} red balls and {k + 3} blue balls. What is the smallest number of balls you must take out, "
        f"without looking, to be sure you have two of the same color?",
        f"I have {k} coins and lose half of them, then find {rng.randint(1, 9)} more. Can I end up with a fraction "
        f"of a coin? Reason step by step.",
        f"{a} says: '{b} is lying.' {b} says: '{c} is lying.' {c} says: 'Both {a} and {b} are lying.' Who tells the truth?",
        f"A clock shows {rng.randint(1, 11)}:{rng.choice(['00', '15', '30', '45'])}. What is the angle between the hour "
        f"and minute hands?",
    ]
    return rng.choice(forms)


QA = [
    "In one or two sentences: where does {topic} come from?", "Quick question: who first studied {topic}?",
    "Answer briefly: what is the main purpose of {topic}?", "Short answer please: how old is the idea of {topic}?",
    "What is one surprising number or statistic related to {topic}?", "Is {topic} found everywhere in the world?",
    "Name one famous person connected to {topic} and say why.", "What is the English word for {topic} in science?",
]

ESSAY = [
    "Discuss the role of {topic} in modern society.", "Write a persuasive paragraph arguing that {topic} deserves more attention.",
    "What ethical questions does {topic} raise?", "Describe how {topic} has changed over the last hundred years.",
    "Write a short essay on the cultural importance of {topic}.", "What would the world look like without {topic}?",
    "Argue for and against spending public money on {topic}.", "How might {topic} change in the next twenty years?",
    "Write a reflective paragraph on what {topic} teaches us about people.",
]

STRUCTURED = [
    "Make a table with three columns comparing {a} and {b}.", "Describe {topic} as a JSON object with a few fields.",
    "Write a recipe-style step-by-step guide for getting started with {topic}.",
    "Create a weekly schedule in a table for someone who wants to learn about {topic}.",
    "Write an outline with headings and bullet points for a talk on {topic}.",
    "Give a FAQ with three questions and answers about {topic}.",
    "Write a short glossary of five terms related to {topic}.",
]

SNIPPETS = [
    ("def average(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)",
     "Python"),
    ("def is_even(n):\n    return n % 2 == 1", "Python"),
    ("function sum(arr) {\n  let s = 0;\n  for (let i = 0; i <= arr.length; i++) s += arr[i];\n  return s;\n}",
     "JavaScript"),
    ("def last(items):\n    return items[len(items)]", "Python"),
    ("int max(int a, int b) {\n    if (a > b) return b;\n    return a;\n}", "C"),
    ("def count_words(text):\n    return len(text.split(' '))", "Python"),
    ("def reverse(s):\n    out = ''\n    for ch in s:\n        out = out + ch\n    return out", "Python"),
    ("for i in range(10):\n    if i % 3 == 0:\n        print(i)", "Python"),
]
CODE_READ = [
    "What does this {lang} code do?\n\n```\n{code}\n```",
    "Find the bug in this {lang} code and fix it:\n\n```\n{code}\n```",
    "Explain this {lang} code line by line:\n```\n{code}\n```",
    "How could this {lang} code be improved?\n```\n{code}\n```",
]


def _multi_step(rng: random.Random) -> str:
    name = rng.choice(NAMES)
    item, lo, hi = rng.choice(ITEMS)
    a, b, c, d = rng.randint(2, 12), rng.randint(2, 9), rng.randint(10, 60), rng.randint(2, 5)
    forms = [
        f"{name} buys {a} {item} at ${rng.randint(lo, hi)} each and {b} more at ${rng.randint(lo, hi) + 1} each, "
        f"then gets a {c % 30 + 5}% discount on the total. How much does {name} pay?",
        f"A farm has {a * 10} chickens. Each lays {b} eggs a week. Eggs are sold in cartons of 12 for ${d}. "
        f"How much money does the farm make in a week?",
        f"{name} runs {b} km on weekdays and {a} km on each weekend day. How many km is that in {d} weeks?",
        f"A tank holds {c * 10} liters. It is filled at {a + 5} liters per minute and leaks {b} liters per minute. "
        f"How long until it is full?",
        f"A shop sells {c} {item} on Monday, {d} times as many on Tuesday, and {a} fewer than Tuesday on Wednesday. "
        f"How many in total?",
    ]
    return rng.choice(forms)


KINDS_2 = [("roleplay", 3), ("reasoning", 3), ("qa", 3), ("essay", 3), ("structured", 2), ("code_read", 2),
           ("multi_step", 2)]


def _fill_2(rng: random.Random, kind: str) -> str:
    topic = rng.choice(TOPICS)
    if kind == "roleplay":
        return rng.choice(ROLEPLAY).format(persona=rng.choice(PERSONAS), topic=topic, audience=rng.choice(AUDIENCES))
    if kind == "reasoning":
        return _reasoning(rng)
    if kind == "qa":
        return rng.choice(QA).format(topic=topic)
    if kind == "essay":
        return rng.choice(ESSAY).format(topic=topic)
    if kind == "structured":
        a, b = rng.choice(PAIRS)
        return rng.choice(STRUCTURED).format(topic=topic, a=a, b=b)
    if kind == "code_read":
        code, lang = rng.choice(SNIPPETS)
        return rng.choice(CODE_READ).format(code=code, lang=lang)
    if kind == "multi_step":
        return _multi_step(rng)
    raise ValueError(kind)


def _stream(seed: int, kinds: list[tuple[str, int]], fill, prefix: str):
    """Distinct prompts of one stream until its templates are used up; deterministic in seed."""
    rng = random.Random(seed)
    names, weights = zip(*kinds)
    seen: set[str] = set()
    misses = 0
    while misses < 5000:  # 5000 repeats in a row: nothing new is left
        kind = rng.choices(names, weights)[0]
        text = fill(rng, kind)
        if text in seen:
            misses += 1
            continue
        misses = 0
        seen.add(text)
        yield {"id": f"{prefix}{seed}-{len(seen) - 1}", "kind": kind, "messages": [{"role": "user", "content": text}]}


def generate_prompts(n: int, seed: int = 0) -> list[dict]:
    """n distinct single-turn prompts: every fourth from the second stream (KINDS_2), the rest
    from the first (KINDS); each stream is mixed over its kinds by weight."""
    first, second = _stream(seed, KINDS, _fill, "s"), _stream(seed + 1_000_003, KINDS_2, _fill_2, "r")
    out: list[dict] = []
    for i in range(n):
        prompt = next(second if i % 4 == 3 else first, None) or next(first, None) or next(second, None)
        if prompt is None:
            break
        out.append(prompt)
    return out


PASSAGE_TASKS = [
    ("summarize", "Summarize the following text in two sentences.\n\n{text}"),
    ("summarize", "{text}\n\nWrite a one-sentence summary of the text above."),
    ("summarize", "Give a short summary of this paragraph:\n{text}"),
    ("rewrite", "Rewrite the following text in simpler words:\n\n{text}"),
    ("rewrite", "Rewrite this paragraph in a more formal tone.\n\n{text}"),
    ("extract", "Read the text below and list the key facts it mentions as bullet points.\n\n{text}"),
    ("extract", "{text}\n\nExtract every noun phrase that names a thing or a place from the text above."),
    ("question", "{text}\n\nBased on the text above, what is the main idea? Answer briefly."),
    ("question", "Here is a paragraph:\n{text}\n\nWrite three questions that can be answered from it."),
    ("title", "Suggest a good title for this text:\n\n{text}"),
]

FOLLOW_UPS = ["Can you make it shorter?", "Now explain it in simpler words.", "Give me one more example.",
              "Can you turn that into a bulleted list?", "Thanks! Can you add a short conclusion?",
              "Rewrite your answer in a more cheerful tone."]


DOCUMENT_TASKS = [
    ("summarize_long", "Summarize the following article in one paragraph.\n\n{doc}"),
    ("summarize_long", "{doc}\n\nWhat are the three most important points of the text above?"),
    ("extract_long", "Read the document and return a JSON list of the topics it covers, each with one key fact.\n\n{doc}"),
    ("rag", "Use only the documents below to answer.\n\n{numbered}\n\nQuestion: what is the main point of Document {k}?"),
    ("rag", "{numbered}\n\nWhat do the documents above have in common, and how does Document {k} differ from the others?"),
]


def passage_tasks(passages: list[str], seed: int = 0, prefix: str = "", single=PASSAGE_TASKS,
                  several=DOCUMENT_TASKS, sizes: tuple[int, ...] = (3,)) -> list[dict]:
    """Prompts that work on text the target wrote itself: one per passage (`single`: summarize /
    rewrite / extract / ...), then one per group of consecutive passages (group j joins
    sizes[j % len(sizes)] of them) as a long document or a set of numbered documents (`several`:
    long-context summarizing, extraction and document QA). Ids `p<prefix><seed>-i` and
    `m<prefix><seed>-j`."""
    rng = random.Random(seed + 7919)
    out = []
    for i, text in enumerate(passages):
        kind, template = rng.choice(single)
        out.append({"id": f"p{prefix}{seed}-{i}", "kind": kind,
                    "messages": [{"role": "user", "content": template.format(text=text.strip())}]})
    rng = random.Random(seed + 104729)
    start, j = 0, 0
    while start + sizes[j % len(sizes)] <= len(passages):
        size = sizes[j % len(sizes)]
        group = [t.strip() for t in passages[start : start + size]]
        kind, template = rng.choice(several)
        numbered = "\n\n".join(f"Document {k + 1}:\n{t}" for k, t in enumerate(group))
        out.append({"id": f"m{prefix}{seed}-{j}", "kind": kind,
                    "messages": [{"role": "user", "content": template.format(doc="\n\n".join(group), numbered=numbered,
                                                                              k=rng.randint(1, size))}]})
        start, j = start + size, j + 1
    return out


# The document stream (`document_prompts`, ids `w<seed>-k`): passages in many genres, written by
# the target, that become longer and more varied document tasks than the main stream's (groups of
# two to five passages), so a head learns to draft answers that copy from a long context.
DOC_GENRES = [
    "Write a short news article about {topic}.", "Write an encyclopedia entry about {topic}.",
    "Write a how-to guide about {topic} with numbered steps.", "Write a short product description of a {product}.",
    "Write a short biography of {name}, a fictional expert on {topic}.", "Write the minutes of a club meeting about {topic}.",
    "Write an email from {name} to a colleague about {topic}.", "Write a travel guide paragraph about a town famous for {topic}.",
    "Write a short report with numbers and dates about {topic}.", "Write a customer review of a {product}.",
    "Write a short interview with {name} about {topic}.", "Write a museum label describing an exhibit on {topic}.",
    "Write a school textbook paragraph about {topic} for {audience}.", "Write a press release about a new {product}.",
    "Write a short history of {topic} with a few key dates.", "Write a diary entry by {name} about a day spent on {topic}.",
    "Write a FAQ section about {topic}.", "Write a job advertisement for a position related to {topic}.",
]

DOC_SINGLE = PASSAGE_TASKS + [
    ("extract", "{text}\n\nExtract all names, numbers and dates from the text above as a JSON object."),
    ("extract", "From the following text, list every person mentioned and what they did.\n\n{text}"),
    ("extract", "Read this text and fill in a table with the columns Item, Detail.\n\n{text}"),
    ("question", "Answer using only the text below. What is the most important fact it states?\n\n{text}"),
    ("question", "{text}\n\nDoes the text above mention any numbers? Quote them with their context."),
    ("summarize", "Summarize this in three bullet points:\n\n{text}"),
    ("rewrite", "Correct and improve the grammar and style of the following text:\n\n{text}"),
    ("rewrite", "Rewrite the text below so that a child can understand it.\n\n{text}"),
]

DOC_SEVERAL = DOCUMENT_TASKS + [
    ("summarize_long", "Write a short news summary that covers all of the following material.\n\n{doc}"),
    ("summarize_long", "{doc}\n\nSummarize the text above in five bullet points."),
    ("extract_long", "{numbered}\n\nList every name, number and date in the documents above, with the document it is from."),
    ("extract_long", "Read the documents and make a table with one row per document: title, topic, main fact.\n\n{numbered}"),
    ("rag", "Answer the question using the documents. Cite the document number.\n\n{numbered}\n\n"
            "Question: which document is the most useful for a beginner, and why?"),
    ("rag", "{numbered}\n\nUsing only Document {k}, write three questions and their answers."),
    ("rag", "Context:\n{numbered}\n\nBased on the context, what facts does Document {k} state? Quote them."),
]


def _fill_doc(rng: random.Random, kind: str) -> str:
    return rng.choice(DOC_GENRES).format(topic=rng.choice(TOPICS), product=rng.choice(PRODUCTS),
                                         name=rng.choice(NAMES), audience=rng.choice(AUDIENCES))


def document_prompts(n: int, seed: int = 0) -> list[dict]:
    """n distinct passage-writing prompts of the document stream (kind `passage`)."""
    stream = _stream(seed + 2_000_029, [("passage", 1)], _fill_doc, "w")
    return [p for _, p in zip(range(n), stream)]


BACK_TRANSLATE = [
    "Translate the following {lang} text into English:\n\n{text}", "Translate to English: {text}",
    "What does this {lang} text mean in English?\n{text}", "Please translate this from {lang} to English.\n\n{text}",
]


def back_translation_tasks(translations: list[tuple[str, str]], seed: int = 0) -> list[dict]:
    """translations: (language, text the target wrote in it) -> prompts to translate it back to
    English, one to four texts of the same language joined (ids `t<seed>-<crc32 of the text>`)."""
    rng = random.Random(seed + 15_485_863)
    by_lang: dict[str, list[str]] = {}
    for lang, text in translations:
        by_lang.setdefault(lang, []).append(text.strip())
    out = []
    for lang in sorted(by_lang):
        texts, start = by_lang[lang], 0
        while start < len(texts):
            size = rng.randint(1, 4)
            text = " ".join(texts[start : start + size])
            # Ids hash the text: the set of finished translations grows between runs, which moves
            # the groups, and a resumed run must not take a new group for an answered one.
            out.append({"id": f"t{seed}-{zlib.crc32(text.encode())}", "kind": "back_translation",
                        "messages": [{"role": "user", "content": rng.choice(BACK_TRANSLATE).format(lang=lang, text=text)}]})
            start += size
    return out


def follow_up_text(seed: int) -> str:
    """The user's second turn on a finished first turn."""
    return random.Random(seed).choice(FOLLOW_UPS)


def next_turn(messages: list[dict], answer: str, user: str) -> list[dict]:
    """The conversation one turn on: the answer to its last user turn, then the user's next turn."""
    return messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": user}]
