"""Texts for the lab's long-context workloads, written for this project (no outside source).

* ``STORY``: an original short story (~1,100 words, ~1,250 SmolLM2 tokens) full of names,
  numbers and small facts that a later question can ask for, so that a cache which forgot
  the beginning shows it.
* ``STORY_QUESTION``: a question about it for a chat model; ``STORY_CUE``: the start of a
  summary for a base model (plain completion) to continue; ``story_excerpt`` and
  ``EXCERPT_QUESTION``: a ~1K-token cut of it for quick runs.
* ``CONVERSATION``: a four-turn chat: meeting notes, then follow-up questions whose answers
  sit early in the notes.

The author of this module places these texts in the public domain.
"""

from __future__ import annotations


def _unwrap(text: str) -> str:
    """Paragraphs separated by blank lines; line breaks inside a paragraph become spaces."""
    paragraphs = [" ".join(p.split()) for p in text.strip().split("\n\n")]
    return "\n\n".join(paragraphs)


STORY = _unwrap(
    """
The Keeper of Varrow Point

The lighthouse at Varrow Point was built in 1871 from grey granite quarried at Tessel, a
village nine miles up the coast, and for most of its life it was kept by members of a single
family, the Calloways. The last of them, Ines Calloway, took over the lamp in the autumn of
1952, when she was twenty-six years old and her father's eyes had begun to fail. The
harbour board in Lenmouth doubted that a young woman could manage the work alone, so they
sent an inspector named Bartholomew Quill to watch her for a month. Quill arrived with two
suitcases, a barometer wrapped in a blanket, and the firm belief that he would be home
before the first frost.

The tower had one hundred and twelve steps. Ines climbed them six times a day: at dusk to
light the lamp, at ten and at two to trim the wick and wind the clockwork that turned the
lens, at dawn to put the lamp out, and twice more to polish the brass and the glass. The lens
was a second-order Fresnel lens made in Paris, and it threw a white flash every eleven
seconds, which sailors called the Varrow wink. In the logbook Ines wrote the weather, the
ships she saw, the oil she burned, and, in the margins, the names of birds. Quill read the
logbook every evening and found nothing to correct, which annoyed him more than he admitted.

In the third week of October a storm came in from the south-west. It began as a long swell
on a windless afternoon, and by nightfall the spray was reaching the gallery, sixty feet
above the rocks. At a quarter past eleven the clockwork stopped. A pin in the governor had
sheared, and without it the lens would not turn; a fixed light instead of a flash could be
mistaken for a ship's lamp, or for the harbour light at Lenmouth, and a captain who mistook
one for the other would steer straight onto the Needles, a reef that had already claimed
four ships that century. Ines did not wait for Quill. She took the handle from its hook and
turned the lens by hand, counting eleven seconds for each flash, and she kept turning it
until six in the morning, with her left arm when her right one gave out.

Quill found her there at two o'clock, when he climbed up to complain about the noise of the
shutters. He did not offer to take over, because he was afraid of heights, but he sat on the
top step and counted out loud with her so that she would not lose the rhythm. Between them
they counted, by his reckoning, a little over two thousand flashes. At first light a coal
steamer, the Marigold of Cardiff, was seen riding out the weather safely in the lee of Tessel
Head. Her captain wrote to the harbour board a week later to say that he had seen the Varrow
wink through the rain and had known exactly where he was.

While she was cleaning the lantern room the next afternoon, Ines found something that had
nothing to do with the storm. Behind a loose panel under the lens pedestal, wrapped in oiled
cloth, was a small tin box. Inside it were seventeen letters written by her great-grandmother,
Rosalind Calloway, the first keeper's wife, to a sister in Halifax, Nova Scotia. The letters
had never been posted. They described the building of the tower, the winter the well froze,
the birth of three children in the keeper's cottage, and a shipwreck in 1879 in which
Rosalind and her husband rowed out twice in the dark and brought back nine sailors from a
schooner called the Ardent. In the last letter Rosalind wrote that she was hiding the others
because her husband thought letters about hardship would frighten the family in Canada, and
that one day someone would find them and know what the light had cost.

Quill stayed three more days than his month. His report to the harbour board was four lines
long. It said that the station at Varrow Point was in good order, that the keeper was
competent, and that the governor pin should be replaced with one of hardened steel. He did
not mention the night of the storm. Ines only learned years later, from a clerk in Lenmouth,
that Quill had added a private note asking the board to raise her pay by one pound a month
and to send a second handle, in case the first one wore out.

Ines kept the light for twenty-three more years. She married a fisherman from Tessel named
Owen Hart, who learned to wind the clockwork and to read her handwriting in the logbook, and
they had one daughter, Maud. In 1975 the board decided to automate the lighthouse. An
electric lamp and a motor were installed, the Fresnel lens was kept because nothing made
since could throw a better beam, and the keeper's cottage was sold. On her last night Ines
climbed the steps one more time, wound the clockwork that was no longer needed, and wrote in
the logbook: wind south-west, light rain, one heron, all well.

What happened to the lighthouse after that was decided by the village. The harbour board
wanted to sell the tower to a company that made radio masts. The people of Tessel and
Lenmouth collected money for two years, held a fair every August, and in 1978 bought the
tower and the cottage for four thousand pounds. They turned the cottage into a small museum.
Rosalind's seventeen letters are displayed there in a glass case, next to Ines's logbook, the
handle she turned through the night of the storm, and a framed copy of Bartholomew Quill's
four-line report. Every year on the third Saturday of October the lamp is switched off for a
minute at a quarter past eleven, and someone from the village climbs the one hundred and
twelve steps to turn the lens by hand and count the flashes, eleven seconds apart.
"""
)


def story_excerpt(paragraphs: int) -> str:
    """The title and the first ``paragraphs - 1`` paragraphs of ``STORY``."""
    return "\n\n".join(STORY.split("\n\n")[:paragraphs])


EXCERPT_PARAGRAPHS = 7  # ~950 SmolLM2 tokens: title to Quill's report
EXCERPT_QUESTION = (
    "Read the story above and answer: who was Ines Calloway, what did she do on the night "
    "of the storm, and what did she find in the lantern room? Answer in a short paragraph."
)

STORY_QUESTION = (
    "Read the story above and answer: who was Ines Calloway, what did she do on the night "
    "of the storm, what did she find in the lantern room, and what did the village do with "
    "the lighthouse in the end? Answer in a short paragraph."
)

STORY_CUE = (
    "\n\nSummary of the story. Ines Calloway became the keeper of the lighthouse at Varrow "
    "Point in the year"
)


NOTES = _unwrap(
    """
Notes from the Elm Row allotment committee meeting, Tuesday 4 March. Present: Priya Shah
(chair), Tomasz Nowak (treasurer), Grace Obi, Hamid Rezai, and Lena Fischer, who took these
notes.

1. Water. The old water tank behind plot 14 leaks at the seam. The committee decided not to
repair it. A new 1,000-litre tank will be bought from Hollins Farm Supply for 240 pounds and
placed on the concrete base by the north gate, where the downpipe from the shed roof can
fill it. Hamid will collect it on Saturday 15 March with his van.

2. The shed. The shed door has come off its top hinge and the roof felt is torn. Grace
offered to repair both on Sunday 23 March; she asked for two volunteers to hold the ladder.
Roof felt and hinges will cost about 45 pounds.

3. Money. Tomasz reported 610 pounds in the fund at the start of the meeting. The tank and
the shed repairs were approved. Plot fees of 30 pounds a year are due by 1 April; four
plots have not paid yet (plots 3, 9, 17 and 21).

4. Plots. Plot 9 is to be offered to the first person on the waiting list, Mr. Daniel Kerr,
if its holder does not reply by the end of March. Plot 22 will be split into two half
plots for the primary school's gardening club.

5. Next meeting: Tuesday 1 April at 7 pm in the church hall on Elm Row. Bring seed catalogues
for the joint order.
"""
)

CONVERSATION = (
    NOTES + "\n\nWhat did the committee decide about the water tank?",
    "Who offered to repair the shed, and on what date?",
    "How much money will be left in the fund after the tank and the shed repairs?",
    "Write a short reminder to all members about the next meeting.",
)
