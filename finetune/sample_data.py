"""Generate the small, original MuDoConv-format sample dataset shipped in ``data/sample``.

    python -m finetune.sample_data [--out_dir data/sample] [--seed 0]

Every line is ``{"texts": SOURCE, "labels": REPLY}`` with SOURCE built by
``chat.prompt.build_source``. Dialogues of 2-4 exchanges are drawn from the templates below (one
kind per dialogue; each takes the kind with the fewest rows so far) and give one row per bot
reply, the history growing one exchange at a time while the source stays within
``MAX_SOURCE_CHARS``. Exact duplicate rows are dropped, and validation repeats no train row. Replies are strongly tied
to the context (a persona fact, the emotion's own phrase, the task domain, a topic fact) so that
a tiny model visibly learns to use it. All text here was written for this project.
Output depends only on the arguments: each split has its own ``random.Random`` seeded with the
string ``"{seed}:{split}"``, and some (kind, context, opening) combinations are kept for
validation only (``HOLDOUT_MOD``).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import zlib
from collections import Counter
from pathlib import Path

from chat.prompt import EMOTIONS, KINDS, build_source

log = logging.getLogger(__name__)

MAX_SOURCE_CHARS = 256
HOLDOUT_MOD = 8  # a dialogue whose crc32(kind|context|opening) % HOLDOUT_MOD == 0 is validation-only

# Slot values shared by all templates; one value per slot is drawn per dialogue.
SLOTS = {
    "who": ("my brother", "my sister", "my best friend", "my roommate", "my neighbor", "my cousin"),
    "n": ("two", "three", "four", "five", "six"),
    "nights": ("two", "three", "four", "five"),
    "mins": ("ten", "fifteen", "twenty", "thirty"),
    "time": ("six pm", "seven pm", "eight pm", "noon", "nine am"),
    "day": ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"),
    "city": ("paris", "rome", "tokyo", "london", "chicago", "madrid", "boston", "berlin", "sydney"),
    "price": ("90", "120", "150", "200", "250", "300"),
    "scene": ("beach", "mountains"),
    "weather": ("sunny", "rainy", "cloudy", "windy", "snowy", "warm and clear"),
    "movie": ("space dogs", "the red door", "night train", "ocean story", "the last dragon"),
    "street": ("oak", "main", "pine", "park", "lake", "river"),
    "topping": ("cheese", "pepperoni", "mushroom", "veggie", "ham"),
    "activity": ("watching tv", "cooking dinner", "reading a book", "walking my dog", "doing laundry"),
    "thing": ("movies", "music", "pizza", "the rain", "video games", "long walks", "board games"),
    "place": ("the park", "the mall", "the gym", "the beach", "the store", "the library"),
    "mood": ("good", "fine", "great", "okay", "pretty good"),
}

# persona: (category, persona sentence, reply that uses it)
PERSONA_FACTS = (
    ("pets", "i love dogs.", "i love dogs, i have two of them."),
    ("pets", "i have a cat.", "i have a cat named tom, he sleeps all day."),
    ("pets", "i own a horse.", "i have a horse, i ride her every weekend."),
    ("job", "i work as a nurse.", "i am a nurse, i work at the hospital."),
    ("job", "i am a teacher.", "i am a teacher, i teach kids at a small school."),
    ("job", "i drive a bus.", "i drive a bus in the city."),
    ("job", "i am a chef.", "i am a chef, i cook at a busy restaurant."),
    ("hobby", "i like to paint.", "i like to paint, mostly trees and lakes."),
    ("hobby", "i love to hike.", "i love to hike in the hills on sundays."),
    ("hobby", "i read a lot.", "i read a lot, mostly old books."),
    ("food", "i love pizza.", "pizza is my favorite, i could eat it every day."),
    ("food", "i am vegan.", "i am vegan, so i eat lots of beans and rice."),
    ("food", "i bake bread.", "i bake my own bread every week."),
    ("home", "i live by the sea.", "i live by the sea, i can hear the waves at night."),
    ("home", "i live on a farm.", "i live on a farm with lots of cows."),
    ("home", "i live in a big city.", "i live in a big city, it is loud but fun."),
    ("music", "i play the guitar.", "i play the guitar, mostly rock songs."),
    ("music", "i sing in a choir.", "i sing in a choir every thursday."),
    ("music", "i love jazz.", "i love jazz, i listen to it all day."),
    ("family", "i have three sisters.", "i have three sisters, we are very close."),
    ("family", "i am a dad.", "i am a dad of two little boys."),
    ("family", "i live with my grandma.", "i live with my grandma, she tells great stories."),
    ("sport", "i play soccer.", "i play soccer with my friends on weekends."),
    ("sport", "i swim every morning.", "i swim every morning at the pool."),
    ("sport", "i run marathons.", "i run marathons, my last one was in the rain."),
)
PERSONA_QUESTIONS = {
    "pets": ("do you have any pets?", "are you an animal person?"),
    "job": ("what do you do for work?", "what is your job?"),
    "hobby": ("what do you do for fun?", "do you have any hobbies?"),
    "food": ("what do you like to eat?", "what is your favorite food?"),
    "home": ("where do you live?", "what is your home like?"),
    "music": ("do you like music?", "what music are you into?"),
    "family": ("tell me about your family.", "do you have a big family?"),
    "sport": ("do you play any sports?", "how do you stay fit?"),
    "any": ("tell me about yourself.", "what else do you like?", "tell me more about you."),
}
PERSONA_OPENERS = ("", "hi! ", "hello. ", "nice to meet you. ")
PERSONA_FOLLOWERS = ("", "cool. ", "oh nice. ", "that is neat. ", "i am a student. ", "i have a dog too. ")
PERSONA_TAILS = ("", "", " what about you?", " and you?")

# The tables below keep one entry per line, however long: they read (and diff) as tables, where
# the formatter would put every string on a line of its own.
# fmt: off
# ruff: disable[E501]
# emotion: label -> (group, the label's own reply phrase, situations the user tells)
EMOTION_DATA = {
    "afraid": ("fear", "oh no, that sounds really scary.", ("i heard a strange noise outside last night.", "a big dog ran at me on my walk.", "{who} drove way too fast with me in the car.")),
    "angry": ("anger", "that would make me angry too!", ("{who} broke my phone and did not say sorry.", "someone took my parking spot again.", "my package was stolen from my door.")),
    "annoyed": ("anger", "ugh, that is so annoying.", ("{who} keeps chewing so loud.", "my neighbor plays music all night.", "the bus was late three days in a row.")),
    "anticipating": ("hope", "i can not wait to hear how it goes!", ("my vacation starts next week.", "{who} is coming to visit soon.", "the new season of my show comes out friday.")),
    "anxious": ("worry", "try to breathe, it will be okay.", ("i have a big test tomorrow.", "i am waiting on news from the doctor.", "i have a job interview on monday.")),
    "apprehensive": ("worry", "it is normal to feel unsure about that.", ("i start a new job next week.", "i have to speak in front of everyone soon.", "i am moving to a new city.")),
    "ashamed": ("shame", "everyone makes mistakes, do not be too hard on yourself.", ("i lied to {who} about something small.", "i yelled at my kids for no reason.", "i forgot {who}'s birthday.")),
    "caring": ("warm", "that is so kind of you to help.", ("i made soup for {who} who is sick.", "i have been looking after my old neighbor.", "i helped a lost kid find his mom.")),
    "confident": ("hope", "you sound so sure, i believe in you!", ("i know i will pass my driving test.", "i practiced my speech all week.", "i think i nailed my interview.")),
    "content": ("joy", "that sounds so calm and nice.", ("i spent a quiet sunday reading in the park.", "i have a warm tea and a good book.", "life has been calm and good lately.")),
    "devastated": ("sad", "i am so sorry, that is heartbreaking.", ("my dog passed away last week.", "i lost my job today.", "{who} is moving far away for good.")),
    "disappointed": ("sad", "oh, that is a real letdown.", ("i did not get the job i wanted.", "{who} cancelled our plans again.", "my team lost the final.")),
    "disgusted": ("anger", "yuck, that is so gross!", ("i found a hair in my soup.", "someone left old food in the fridge for weeks.", "{who} sneezed right on my plate.")),
    "embarrassed": ("shame", "oh no, how embarrassing!", ("i tripped in front of the whole class.", "i called my teacher mom.", "i waved at someone who was not waving at me.")),
    "excited": ("joy", "wow, how exciting!", ("i just got tickets to see my favorite band!", "we are going to the beach tomorrow!", "i got a new puppy!")),
    "faithful": ("warm", "it is good to stay true to what you believe.", ("i have been with my partner for ten years.", "i go to church every week.", "i stayed loyal to my team all season.")),
    "furious": ("anger", "i would be furious too!", ("{who} crashed my car and left.", "the shop charged me twice and will not fix it.", "someone kicked my dog on purpose.")),
    "grateful": ("warm", "it is great to have people to be thankful for.", ("{who} helped me move all weekend.", "a stranger paid for my coffee.", "my family helped me when i was sick.")),
    "guilty": ("shame", "i am sure you can make it right.", ("i ate the last piece of cake that was for {who}.", "i broke my friend's lamp and did not tell.", "i missed {who}'s big game.")),
    "hopeful": ("hope", "i really hope it works out for you!", ("i just applied for my dream job.", "my mom is getting better every day.", "i think things will turn around this year.")),
    "impressed": ("joy", "wow, that is really impressive!", ("{who} ran a whole marathon.", "my little sister built a robot.", "i saw a man juggle five balls at once.")),
    "jealous": ("anger", "i would be a little jealous too.", ("{who} got the promotion i wanted.", "my friend has a new car and i have an old bike.", "my brother always gets all the attention.")),
    "joyful": ("joy", "that makes me so happy!", ("my baby took her first steps today.", "{who} is getting married!", "i won a small prize in a contest.")),
    "lonely": ("sad", "i am sorry you feel alone, i am here to talk.", ("i moved to a new town and know nobody.", "all my friends are away this summer.", "i ate dinner alone again tonight.")),
    "nostalgic": ("memory", "ah, those were the good old days.", ("i found my old school photos.", "i heard a song from when i was a kid.", "i drove past my first house today.")),
    "prepared": ("hope", "good, it is smart to be ready.", ("i packed everything for my trip days ago.", "i studied every night for the exam.", "i have my speech ready for tomorrow.")),
    "proud": ("joy", "you should be so proud!", ("my son finished school with top marks.", "i finally finished my first painting.", "i ran five miles without stopping.")),
    "sad": ("sad", "i am so sorry to hear that.", ("my best friend moved away.", "i had to give away my cat.", "it rained on my birthday and nobody came.")),
    "sentimental": ("memory", "that is such a sweet memory.", ("i found a letter my grandpa wrote me.", "i still keep my first teddy bear.", "my mom gave me her old ring.")),
    "surprised": ("surprise", "wow, i did not see that coming!", ("{who} threw me a party i did not know about.", "i found twenty dollars in my old coat.", "my old friend called me out of nowhere.")),
    "terrified": ("fear", "that sounds terrifying!", ("i was stuck in an elevator for an hour.", "a snake was in my bed this morning.", "our plane shook so hard in the storm.")),
    "trusting": ("warm", "it is nice to have someone you can trust.", ("i let {who} borrow my car.", "i told {who} my biggest secret.", "i left my kids with a new babysitter.")),
}
# group -> (what the user says next, what the bot adds after the label's phrase)
EMOTION_GROUPS = {
    "joy": (("yes, i am still smiling about it.", "thanks, it has been a great week.", "i know, i can hardly believe it."), ("tell me more about it!", "that is great news.", "i love hearing that.")),
    "hope": (("i have been waiting so long.", "i think it will go well.", "i hope so too."), ("keep me posted!", "what is the plan?", "tell me how it goes.")),
    "warm": (("yes, it means a lot to me.", "it feels good.", "i feel lucky."), ("that is really lovely.", "the world needs more of that.", "that warms my heart.")),
    "memory": (("i miss those days.", "i still have the photos.", "it made me smile and cry."), ("what do you remember most?", "do you still think about it often?", "thank you for sharing it.")),
    "sad": (("yes, it has been really hard.", "thanks for listening.", "i just feel empty."), ("do you want to talk about it?", "is there anything that helps?", "how are you holding up?")),
    "anger": (("i know, i am still mad about it.", "it really got to me.", "i told them how i felt."), ("what did you do next?", "did you talk to them about it?", "how did it end?")),
    "fear": (("yes, my heart was racing.", "i could not sleep that night.", "i am still a bit shaky."), ("are you safe now?", "what happened next?", "is there someone with you?")),
    "worry": (("i keep thinking about it.", "i could not sleep last night.", "what if it goes wrong?"), ("when is it?", "you will do fine, i am sure.", "is there anything i can do to help?")),
    "shame": (("i feel bad about it.", "i wish i could take it back.", "everyone saw it."), ("what happened then?", "it will pass, i promise.", "we all have days like that.")),
    "surprise": (("i know, i did not expect it at all.", "i am still in shock.", "it was so strange."), ("how did you find out?", "what did you do?", "that is wild.")),
}
EMOTION_OPENERS = ("", "hi. ", "so, ", "well, ")
assert tuple(sorted(EMOTION_DATA)) == tuple(sorted(EMOTIONS))

# task: domain -> (requests, bot question, user answers, bot confirmation, closing, (extra q, extra a))
TASK_DOMAINS = {
    "restaurant table": (("book a table for {n}", "get a restaurant table for {n}"), "sure, what time would you like the restaurant table for?", ("at {time}, please.", "{day} at {time}."), "done, your table for {n} is booked for {time}.", "enjoy your meal!", ("do they have vegan food?", "yes, the menu has a few vegan dishes.")),
    "booking flight": (("book a flight to {city}", "find a flight to {city}"), "sure, what day do you want to fly to {city}?", ("on {day}.", "{day}, in the morning if possible."), "i found a flight to {city} on {day} for {price} dollars.", "have a safe flight!", ("can i bring a big bag?", "yes, one checked bag is included in your flight.")),
    "vacation ideas": (("find vacation ideas", "plan a vacation"), "sure, do you like the beach or the mountains?", ("i like the {scene}.", "the {scene}, for sure."), "great, i will find you a quiet place in the {scene} for a week.", "have a great trip!", ("what should i pack?", "for your vacation, pack light clothes and good shoes.")),
    "weather check": (("check the weather in {city}", "know the weather in {city}"), "sure, for which day should i check the weather in {city}?", ("for {day}.", "{day}, please."), "on {day} it will be {weather} in {city}.", "have a nice day!", ("do i need a coat?", "it may be cool at night, so bring a light coat.")),
    "movie tickets": (("buy movie tickets", "get {n} movie tickets"), "sure, which movie would you like to see?", ("{movie}, please.", "i want to see {movie}."), "got it, {n} tickets for {movie} at {time}.", "enjoy the movie!", ("can we get popcorn too?", "yes, you can add popcorn to your movie tickets.")),
    "hotel reservation": (("book a hotel room in {city}", "reserve a hotel in {city}"), "sure, how many nights will you stay in {city}?", ("{nights} nights.", "just {nights} nights, from {day}."), "your hotel room in {city} is booked for {nights} nights.", "have a pleasant stay!", ("is breakfast included?", "yes, the hotel serves breakfast from seven to ten.")),
    "taxi ride": (("call me a taxi", "book a taxi"), "sure, where should the taxi pick you up?", ("at {street} street.", "from {street} street, please."), "a taxi will pick you up at {street} street in {mins} minutes.", "have a good ride!", ("how much will it cost?", "the taxi ride should be about {mins} dollars.")),
    "pizza order": (("order a pizza", "get a pizza delivered"), "sure, what kind of pizza would you like?", ("a {topping} pizza, please.", "{topping}, large."), "ok, one {topping} pizza is on its way.", "enjoy your pizza!", ("how long will it take?", "your pizza should arrive in about {mins} minutes.")),
    "doctor appointment": (("see a doctor", "make a doctor appointment"), "sure, what day works best for your doctor visit?", ("{day} if possible.", "on {day}, in the afternoon."), "you are booked to see the doctor on {day} at {time}.", "i hope you feel better soon!", ("what should i bring?", "please bring your id and insurance card to the doctor.")),
    "train tickets": (("buy a train ticket to {city}", "get train tickets to {city}"), "sure, when do you want to leave for {city}?", ("on {day} at {time}.", "{day} morning."), "you have a seat on the train to {city} on {day}.", "have a nice journey!", ("is there wifi on the train?", "yes, the train has free wifi.")),
}
TASK_REQUESTS = ("can you help me {req}?", "i want to {req}.", "i need to {req}.", "hi, i would like to {req}.", "please help me {req}.")
TASK_THANKS = ("thank you!", "great, thanks.", "perfect, that is all.", "thanks a lot.")

# topic: topic -> facts the bot states (all written for this project)
TOPIC_FACTS = {
    "jazz": ("jazz started in new orleans about a hundred years ago.", "jazz players often make up the music as they play.", "louis armstrong was one of the first jazz stars.", "the saxophone and the trumpet are common in jazz."),
    "the moon": ("the moon goes around the earth about once a month.", "people first walked on the moon in 1969.", "the moon has no air, so there is no wind there.", "the pull of the moon on the sea makes the tides."),
    "chess": ("chess is played on a board with sixty four squares.", "each chess player starts with sixteen pieces.", "the goal of chess is to checkmate the other king.", "chess started in india long ago."),
    "volcanoes": ("a volcano is an opening where hot rock comes out of the earth.", "melted rock is called lava when it comes out of a volcano.", "hawaii was made by volcanoes under the sea.", "some volcanoes sleep for hundreds of years."),
    "dinosaurs": ("dinosaurs lived on earth for over 150 million years.", "birds are close relatives of dinosaurs.", "the t rex had tiny arms but a huge bite.", "most dinosaurs died out about 66 million years ago."),
    "the ocean": ("the ocean covers most of the earth.", "the pacific is the biggest ocean.", "the deepest part of the ocean is about eleven km deep.", "most of the ocean floor has never been seen by people."),
    "honey bees": ("honey bees make honey from flower nectar.", "a bee hive has one queen and thousands of workers.", "bees dance to tell each other where the flowers are.", "bees help plants grow by carrying pollen."),
    "the olympics": ("the olympics started in ancient greece.", "the modern olympics began in 1896 in athens.", "the summer and winter olympics are held two years apart.", "the five olympic rings stand for five parts of the world."),
    "the pyramids": ("the pyramids of giza were built over four thousand years ago.", "the pyramids were tombs for egyptian kings.", "workers moved huge stone blocks to build the pyramids.", "the great pyramid was the tallest building on earth for ages."),
    "coffee": ("coffee comes from the seeds of a red fruit.", "coffee was first used in ethiopia and yemen.", "brazil grows more coffee than any other country.", "coffee has caffeine, which helps people stay awake."),
    "the piano": ("the piano was invented in italy around 1700.", "a normal piano has eighty eight keys.", "when you press a piano key, a small hammer hits a string.", "mozart and beethoven wrote lots of piano music."),
    "mount everest": ("mount everest is the highest mountain on earth.", "mount everest sits between nepal and china.", "people first reached the top of everest in 1953.", "the air on top of everest is very thin."),
    "penguins": ("penguins are birds that can not fly.", "most penguins live in the southern half of the world.", "penguins use their wings to swim fast.", "emperor penguin dads keep the egg warm on their feet."),
    "the internet": ("the internet is a huge network of computers.", "the world wide web was invented in 1989.", "email is older than the web.", "internet data travels through cables under the sea."),
    "soccer": ("soccer is the most popular sport in the world.", "a soccer team has eleven players on the field.", "the soccer world cup is held every four years.", "in soccer only the goalkeeper can touch the ball with their hands."),
    "rainbows": ("a rainbow forms when sunlight passes through rain drops.", "a rainbow has seven main colors.", "you see a rainbow when the sun is behind you.", "sometimes you can see a double rainbow."),
}
TOPIC_OPENERS = ("what do you know about {topic}?", "tell me something about {topic}.", "i have been reading about {topic}.", "i want to learn about {topic}.", "what is cool about {topic}?")
TOPIC_FOLLOWUPS = ("really? tell me more.", "that is cool. what else?", "wow, i did not know that.", "interesting. anything else?", "oh nice, go on.")

# none: generic chit-chat, (user templates, bot replies) pairs
CHAT_GREETING = (("hi, how are you?", "hey! how is it going?", "hello there, how are you?"), ("i am good, thanks for asking. how are you?", "hi! i am doing well, how about you?"))
CHAT_MOOD = (("i am {mood}, thanks.", "{mood}, thank you."), ("glad to hear it. what are you up to today?",))
CHAT_MIDDLE = (
    (("not much, just {activity}.", "i am just {activity}."), ("that sounds nice. i am just relaxing at home.", "nice, that sounds like a good plan.")),
    (("do you like {thing}?",), ("yes, i like {thing} a lot. what about you?",)),
    (("what did you do this weekend?", "how was your weekend?"), ("i mostly rested and went for a walk. how was yours?",)),
    (("i am going to {place} later.", "i have to go to {place} soon."), ("that sounds fun! have a good time at {place}.",)),
    (("any plans for tonight?", "what are you doing tonight?"), ("i think i will watch a movie and go to bed early.",)),
    (("it is so hot today.",), ("yes, it is way too hot, i am staying inside.",)),
    (("it is so cold today.",), ("brr, yes, i need a warm coat.",)),
    (("what is your favorite color?",), ("my favorite color is blue, like the sky.",)),
    (("do you have any fun plans this week?",), ("not really, just work and some rest. you?",)),
    (("i just got back from {place}.",), ("nice, how was it? i have not been to {place} in a while.",)),
    (("i am so tired today.", "i did not sleep well."), ("oh no, maybe you can take a nap later.",)),
    (("what do you do for fun?", "do you have any hobbies?"), ("i like to watch movies and relax.",)),
    (("what kind of music do you like?",), ("i like a bit of everything, mostly pop.",)),
)
CHAT_BYE = (("i have to go now.", "ok, talk to you later.", "bye for now!"), ("ok, it was nice talking to you. bye!", "see you later, take care!"))
# ruff: enable[E501]
# fmt: on


def _fill(template: str, slots: dict) -> str:
    return template.format(**slots)


def _persona(rng: random.Random, n: int, slots: dict) -> tuple[str, list]:
    k, facts = rng.randint(1, 3), []
    for fact in rng.sample(PERSONA_FACTS, len(PERSONA_FACTS)):  # k facts of distinct categories
        if len(facts) < k and fact[0] not in {f[0] for f in facts}:
            facts.append(fact)
    exchanges = []
    for i in range(min(n, len(facts) + 1)):  # mention each fact at most twice
        category, _, reply = facts[i % len(facts)]
        reply = reply if i < len(facts) else "like i said, " + reply
        question = rng.choice(PERSONA_QUESTIONS[rng.choice((category, category, "any"))])
        lead = rng.choice(PERSONA_OPENERS if i == 0 else PERSONA_FOLLOWERS)
        exchanges.append((lead + question, reply + rng.choice(PERSONA_TAILS)))
    return " ".join(f[1] for f in facts), exchanges


def _emotion(rng: random.Random, n: int, slots: dict) -> tuple[str, list]:
    label = rng.choice(EMOTIONS)
    group, phrase, situations = EMOTION_DATA[label]
    user_lines, bot_lines = (rng.sample(lines, len(lines)) for lines in EMOTION_GROUPS[group])
    turns = [rng.choice(EMOTION_OPENERS) + _fill(rng.choice(situations), slots)] + user_lines
    return label, [(turns[i], f"{phrase} {bot_lines[i % len(bot_lines)]}") for i in range(n)]


def _task(rng: random.Random, n: int, slots: dict) -> tuple[str, list]:
    domain = rng.choice(tuple(TASK_DOMAINS))
    requests, ask, answers, confirm, close, extra = TASK_DOMAINS[domain]
    request = rng.choice(TASK_REQUESTS).format(req=rng.choice(requests))
    steps = [
        (request, ask),
        (rng.choice(answers), confirm),
        extra,
        (rng.choice(TASK_THANKS), "you are welcome, " + close),
    ]
    if n == 3 and rng.random() < 0.5:
        del steps[2]
    return domain, [(_fill(u, slots), _fill(b, slots)) for u, b in steps[:n]]


def _topic(rng: random.Random, n: int, slots: dict) -> tuple[str, list]:
    topic = rng.choice(tuple(TOPIC_FACTS))
    facts = rng.sample(TOPIC_FACTS[topic], n)
    follow = rng.sample(TOPIC_FOLLOWUPS, n - 1)
    users = [rng.choice(TOPIC_OPENERS).format(topic=topic)] + follow
    return topic, [(u, f) for u, f in zip(users, facts)]


def _none(rng: random.Random, n: int, slots: dict) -> tuple[str, list]:
    pairs = [CHAT_GREETING, CHAT_MOOD] if rng.random() < 0.5 else []
    pairs += rng.sample(CHAT_MIDDLE, n)
    if rng.random() < 0.3:
        pairs[n - 1] = CHAT_BYE
    return "", [(_fill(rng.choice(u), slots), _fill(rng.choice(b), slots)) for u, b in pairs[:n]]


MAKERS = {"persona": _persona, "emotion": _emotion, "task": _task, "topic": _topic, "none": _none}


def make_dialogue(kind: str, rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    """One dialogue of 2-4 (user turn, bot reply) exchanges and its context."""
    slots = {name: rng.choice(values) for name, values in SLOTS.items()}
    return MAKERS[kind](rng, rng.randint(2, 4), slots)


def is_held_out(kind: str, context: str, exchanges: list) -> bool:
    key = f"{kind}|{context}|{exchanges[0][0]}".encode()
    return zlib.crc32(key) % HOLDOUT_MOD == 0


def dialogue_rows(kind: str, context: str, exchanges: list) -> list[dict]:
    """One row per bot reply, history growing an exchange at a time within MAX_SOURCE_CHARS."""
    rows, turns = [], []
    for user, bot in exchanges:
        turns.append(user)
        source = build_source(kind, context or None, turns)
        if len(source) > MAX_SOURCE_CHARS:
            break
        rows.append({"texts": source, "labels": bot})
        turns.append(bot)
    return rows


def generate_split(n_dialogues: int, rng: random.Random, allow_held_out: bool, seen: set) -> tuple[list[dict], Counter]:
    """Rows of ``n_dialogues`` dialogues, skipping rows already in ``seen`` (then adding them).

    Each dialogue takes the kind that has the fewest rows so far, so kinds get equal shares.
    """
    rows, per_kind = [], Counter({kind: 0 for kind in KINDS})
    for _ in range(n_dialogues):
        kind = min(KINDS, key=lambda k: per_kind[k])
        while True:
            context, exchanges = make_dialogue(kind, rng)
            if allow_held_out or not is_held_out(kind, context, exchanges):
                break
        for row in dialogue_rows(kind, context, exchanges):
            if (row["texts"], row["labels"]) not in seen:
                seen.add((row["texts"], row["labels"]))
                rows.append(row)
                per_kind[kind] += 1
    return rows, per_kind


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out_dir", default="data/sample")
    parser.add_argument("--n_train_dialogues", type=int, default=700)
    parser.add_argument("--n_val_dialogues", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    seen: set = set()  # validation never repeats a train row
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits = (("train", args.n_train_dialogues, False), ("validation", args.n_val_dialogues, True))
    for split, n, allow_held_out in splits:
        rng = random.Random(f"{args.seed}:{split}")
        rows, per_kind = generate_split(n, rng, allow_held_out, seen)
        write_jsonl(out / f"{split}.jsonl", rows)
        counts = ", ".join(f"{k}={per_kind[k]}" for k in KINDS)
        log.info("wrote %d rows to %s (%s)", len(rows), out / f"{split}.jsonl", counts)


if __name__ == "__main__":
    main()
